"""prepare-data: byte and BPE tokenisation round trips, piece boundaries, metadata and split,
a reused tokenizer.json, data.kind=prepared setting the vocabulary, the whole-file id check."""
import json
import os

import numpy as np
import pytest

from gridshard.config import resolve_config
from gridshard.data.prepare import check_token_ids, open_prepared, prepare_data, prepared_tokenizer, read_piece
from gridshard.errors import ConfigError

LINES = ["def f(x):\n", "    return x * 2  # é ü ∑\n", "\n", "class A:\n", "    pass\n", "\n\n", "print('hi')\n"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(5):
        (root / f"doc{i}.txt").write_text("".join(LINES[j] for j in rng.integers(0, len(LINES), 300)))
    (root / "sub").mkdir()
    (root / "sub" / "last.txt").write_text("the end\n" * 50)
    (root / ".hidden").write_text("never read")
    return root


def _files(root):
    return [root / f"doc{i}.txt" for i in range(5)] + [root / "sub" / "last.txt"]


def test_piece_boundaries_cover_every_line_once(corpus):
    path = str(corpus / "doc0.txt")
    data = open(path, "rb").read()
    for chunk in (1, 7, 64, 10_000):
        pieces = [read_piece(path, a, min(a + chunk, len(data))) for a in range(0, len(data), chunk)]
        assert b"".join(pieces) == data
        assert all(p.endswith(b"\n") or p == b"" for p in pieces)


def test_bytes_parallel_is_the_input(corpus, tmp_path):
    meta = prepare_data([str(corpus)], str(tmp_path / "b"), "bytes", val_fraction=0.1, workers=2, chunk_bytes=500,
                        progress=False)
    tokens = open_prepared(str(tmp_path / "b"))
    want = b"".join(p.read_bytes() for p in _files(corpus))
    assert bytes(np.asarray(tokens, dtype=np.uint8)) == want and tokens.dtype == np.uint16
    assert meta["vocab_size"] == 256 and meta["documents"] == 6 and meta["n_tokens"] == len(want)
    starts = np.load(tmp_path / "b" / "doc_starts.npy")
    assert list(np.diff(starts)) == [p.stat().st_size for p in _files(corpus)[:-1]]
    assert meta["split"]["val"] == [len(want) - round(0.1 * len(want)), len(want)]


def test_trained_bpe_round_trip_then_reused(corpus, tmp_path):
    meta = prepare_data([str(corpus)], str(tmp_path / "t"), "train", vocab_size=300, val_fraction=0.0, workers=2,
                        chunk_bytes=700, progress=False)
    tok = prepared_tokenizer(str(tmp_path / "t"))
    tokens = open_prepared(str(tmp_path / "t"))
    starts = list(np.load(tmp_path / "t" / "doc_starts.npy")) + [len(tokens)]
    assert meta["vocab_size"] == tok.vocab_size <= 300 and meta["max_id"] < meta["vocab_size"]
    assert len(tokens) < sum(p.stat().st_size for p in _files(corpus)) / 1.5     # merges compress
    for i, p in enumerate(_files(corpus)):                # each document decodes back, then <|endoftext|>
        doc = tokens[starts[i]:starts[i + 1]]
        assert doc[-1] == tok.eos_id == 0 and tok.decode(doc[:-1]) == p.read_text()
    # an existing tokenizer.json: the same ids, in one process
    prepare_data([str(corpus)], str(tmp_path / "r"), str(tmp_path / "t" / "tokenizer.json"), val_fraction=0.0,
                 workers=1, chunk_bytes=700, progress=False)
    assert np.array_equal(open_prepared(str(tmp_path / "r")), tokens)

    cfg = resolve_config({"parallel": {}, "data": {"kind": "prepared", "path": str(tmp_path / "t"), "seq_len": 32}},
                         world_size=1)
    assert cfg.model.resolve().vocab_size == meta["vocab_size"] and cfg.data.token_dtype == "uint16"
    with pytest.raises(ConfigError, match="model.vocab_size=256 is invalid.*remove model.vocab_size"):
        resolve_config({"parallel": {}, "model": {"vocab_size": 256},
                        "data": {"kind": "prepared", "path": str(tmp_path / "t"), "seq_len": 32}}, world_size=1)


def test_id_check_reads_the_whole_file(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 250
    ids[777] = 300
    with pytest.raises(ConfigError, match="token id 300 at position 777.*vocab_size=256"):
        check_token_ids(ids, 256, "data", chunk=64)
    check_token_ids(ids, 301, "data", chunk=64)


def test_bad_inputs_are_one_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        prepare_data([str(tmp_path / "missing")], str(tmp_path / "o"), progress=False)
    (tmp_path / "a.txt").write_text("x" * 100)
    with pytest.raises(ConfigError, match="--vocab-size=10 is too small"):
        prepare_data([str(tmp_path / "a.txt")], str(tmp_path / "o"), "train", vocab_size=10, progress=False)
    with pytest.raises(ConfigError, match=r"--val-fraction=1.5 .*\[0, 1\)"):
        prepare_data([str(tmp_path / "a.txt")], str(tmp_path / "o"), val_fraction=1.5, progress=False)
    with pytest.raises(ConfigError, match="not a prepared data folder"):
        resolve_config({"parallel": {}, "data": {"kind": "prepared", "path": str(tmp_path)}}, world_size=1)
    json.dump({"format": "x"}, open(tmp_path / "meta.json", "w"))
    with pytest.raises(ConfigError, match="prepare the data again"):
        resolve_config({"parallel": {}, "data": {"kind": "prepared", "path": str(tmp_path)}}, world_size=1)
    assert not os.path.exists(tmp_path / "o" / "tokens.bin.tmp")
