"""Token sources and the layout-independent batch plan."""
import numpy as np
import pytest
import torch

from gridshard.data import BatchPlan, load_tokens, read_bytes_corpus, source_size_tokens, step_offsets
from gridshard.errors import ConfigError


def _plan(tokens, D, d, micro, G=8, s=16, seed=3, vocab=256):
    return BatchPlan(tokens, s, G, micro, D, d, seed, vocab)


@pytest.mark.parametrize("D,micro", [(1, 8), (1, 2), (2, 4), (2, 1), (4, 2), (8, 1)])
def test_global_batch_is_identical_at_every_layout(D, micro):
    """Data rank d, micro-batch a, row r feeds global row g = d·G/D + a·m + r, i.e. the tokens
    tokens[o_g : o_g + s] and the targets one position later, o = step_offsets(seed, step);
    the expected rows are cut from the raw token array by plain slicing, not by the plan."""
    tokens = np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint8)
    G, s = 8, 16
    for step in (0, 7):
        offsets = step_offsets(len(tokens), s, G, seed=3, step=step)
        expected = torch.tensor(np.stack([tokens[o:o + s + 1] for o in offsets]).astype(np.int64))
        rows = []
        for d in range(D):
            mbs = _plan(tokens, D, d, micro).micro_batches(step)
            assert len(mbs) == G // (micro * D)
            for a, (x, y) in enumerate(mbs):
                assert x.shape == y.shape == (micro, s) and x.dtype == y.dtype == torch.int64
                g0 = d * (G // D) + a * micro
                assert torch.equal(x, expected[g0:g0 + micro, :-1]), (d, a)
                assert torch.equal(y, expected[g0:g0 + micro, 1:]), (d, a)
                rows.append(torch.cat([x, y[:, -1:]], dim=1))
        assert torch.equal(torch.cat(rows), expected)     # every global row exactly once, in order


def test_offsets_depend_on_seed_and_step_only():
    a = step_offsets(10_000, 32, 16, seed=1, step=5)
    assert np.array_equal(a, step_offsets(10_000, 32, 16, seed=1, step=5))
    assert not np.array_equal(a, step_offsets(10_000, 32, 16, seed=1, step=6))
    assert not np.array_equal(a, step_offsets(10_000, 32, 16, seed=2, step=5))
    assert a.min() >= 0 and a.max() <= 10_000 - 33
    with pytest.raises(ConfigError, match="needs data.seq_len"):
        step_offsets(10, 32, 1, 0, 0)


def test_stdlib_corpus_is_deterministic_and_capped():
    a = load_tokens("stdlib", max_bytes=50_000)
    b = read_bytes_corpus("stdlib", None, 50_000)
    assert a.dtype == np.uint8 and len(a) == 50_000 and np.array_equal(a, b)
    assert source_size_tokens("stdlib", None, "uint16", 50_000) == 50_000
    text = bytes(a[:2000]).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_text_folder_in_sorted_order_with_cap(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"BBBB")
    (tmp_path / "a.txt").write_bytes(b"AAAA")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"CC")
    (tmp_path / ".hidden").write_bytes(b"HH")
    assert bytes(load_tokens("text", str(tmp_path), max_bytes=100)) == b"AAAA\nBBBB\nCC\n"
    assert bytes(load_tokens("text", str(tmp_path), max_bytes=7)) == b"AAAA\nBB"
    assert bytes(load_tokens("text", str(tmp_path / "b.txt"), max_bytes=100)) == b"BBBB\n"
    assert source_size_tokens("text", str(tmp_path), "uint16", 100) == 13


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_memmap_and_vocab_check(tmp_path, dtype):
    ids = (np.arange(3000) * 7919 % 60_000).astype(dtype)
    path = tmp_path / "t.bin"
    ids.tofile(path)
    tokens = load_tokens("tokens", str(path), dtype)
    assert isinstance(tokens, np.memmap) and np.array_equal(np.asarray(tokens), ids)
    plan = _plan(tokens, 1, 0, 4, G=4, s=8, vocab=60_000)
    x, y = plan.micro_batches(0)[0]
    off = step_offsets(3000, 8, 4, 3, 0)
    assert torch.equal(x[0], torch.from_numpy(ids[off[0]:off[0] + 8].astype(np.int64)))
    with pytest.raises(ConfigError, match="model.vocab_size=1000"):
        _plan(tokens, 1, 0, 4, G=4, s=8, vocab=1000).micro_batches(0)
