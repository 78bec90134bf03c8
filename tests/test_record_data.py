"""Record sources (issue 41): local Hugging Face datasets (``data.kind: hf``) and chat records
(``data.kind: chat``) — disjoint records per data rank, the same batches at every D, streamed or
not, an exact resume at another D, the chat template's loss mask, and the pre-launch errors."""
import functools
import hashlib
import json

import numpy as np
import pytest

pytest.importorskip("datasets")

from gridshard.config import resolve_config  # noqa: E402
from gridshard.data.chat import END, render  # noqa: E402
from gridshard.data.record_rows import RecordRows  # noqa: E402
from gridshard.data.records import RecordSource, record_tokens  # noqa: E402
from gridshard.data.tokenizer import ByteTokenizer  # noqa: E402
from gridshard.errors import ConfigError  # noqa: E402
from gridshard.testing import run_on_ranks  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _texts(n=120, seed=0):
    g = np.random.default_rng(seed)
    return [f"{i}: " + " ".join(g.choice(WORDS, g.integers(1, 12))) for i in range(n)]


def _write(folder, kind):
    texts = _texts()
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "train.parquet"
        pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path)
    else:
        path = folder / "train.jsonl"
        path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return str(path)


def _chat_records(n=200, seed=1):
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in g.integers(0, 50, 2))
        msgs = [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": str(a + b)}]
        if i % 3 == 0:
            msgs = [{"role": "system", "content": "Answer with a number."}] + msgs
        out.append({"messages": msgs})
    return out


class _Tracking:
    """A record source wrapper that remembers which records were read."""

    def __init__(self, source):
        self.source, self.read = source, set()
        self.streaming, self.size = source.streaming, source.size
        self.dataset = self

    def __getitem__(self, i):
        self.read.add(int(self.source.dataset[i]["n"]))
        return self.source.dataset[i]

    def records(self, start, step=1):
        for i, r in self.source.records(start, step):
            self.read.add(int(r["n"]))
            yield i, r


def _plans(path, D, streaming, packing, mask=True, G=4, s=16):
    tok = functools.partial(record_tokens, kind="hf", field="text", tokenizer=ByteTokenizer(), eod=10)
    return [RecordRows(_Tracking(RecordSource(path, "train", streaming)), tok, s, G, 1, D, d, packing, mask, 10,
                       256, sum_over_data=lambda n: n) for d in range(D)]


def _digest(plans, steps, start=0, first=0):
    """The hash of steps ``start`` … ``steps − 1``'s batches over every plan (steps ``first`` …
    ``start − 1`` read, not hashed)."""
    h = hashlib.sha256()
    for k in range(first, steps):
        for p in plans:
            for parts in p.step_batches(k)[0]:
                for x in parts:
                    if k >= start:
                        h.update(x.numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("kind", ["parquet", "json"])
@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_the_batches_are_the_same_at_every_D_streamed_or_not_and_ranks_read_disjoint_records(kind, packing, tmp_path):
    path = _write(tmp_path, kind)
    digests = set()
    for streaming in (False, True):
        for D in (1, 2, 4):
            plans = _plans(path, D, streaming, packing)
            digests.add(_digest(plans, 6))
            if D == 2 and not streaming:              # a stream is read past others' records; a dataset is not
                a, b = (p.source.read for p in plans)
                assert a and b and not a & b, (sorted(a), sorted(b))
    assert len(digests) == 1


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_a_resume_at_another_D_feeds_exactly_the_uninterrupted_batches(packing, tmp_path):
    path = _write(tmp_path, "parquet")
    whole = _digest(_plans(path, 1, True, packing), 9, start=5)
    first = _plans(path, 2, False, packing)
    _digest(first, 5)
    table = sum(np.asarray(p.position()) for p in first)               # each rank fills its rows
    for D, streaming in ((1, True), (4, False)):
        again = _plans(path, D, streaming, packing)
        for p in again:
            p.load_position(table, 5)
        assert _digest(again, 9, start=5, first=5) == whole, (D, streaming)


def test_packed_record_windows_hold_documents_and_ignore_their_last_targets(tmp_path):
    path = _write(tmp_path, "parquet")
    (plan,) = _plans(path, 1, False, "first_fit", G=4, s=64)
    boundaries = 0
    for k in range(4):
        micro, n = plan.step_batches(k)
        assert n == int(sum((y != -100).sum() for _, y, _ in micro))
        for tokens, targets, docs in micro:
            for r, t in zip(*np.nonzero((docs[:, 1:] != docs[:, :-1]).numpy())):
                boundaries += 1               # a record's last token (its eod) predicts nothing
                assert targets[r, t] == -100 and tokens[r, t] == 10, (k, r, t)
    assert boundaries >= 8


def test_the_chat_template_trains_only_the_assistant_answers():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": "6"}]
    ids, trained = render(msgs, tok, eod=0)
    text = bytes(ids[:-1].tolist()).decode()
    assert text == ("<|system|>\nBe brief.<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n"
                    "<|user|>\n3+3?<|end|>\n<|assistant|>\n6<|end|>\n") and ids[-1] == 0
    assert bytes(ids[trained].tolist()).decode() == "4" + END + "6" + END
    with pytest.raises(ConfigError, match="role"):
        render([{"role": "bot", "content": "x"}], tok)


def _chat_config(path, D=1, steps=6, resume=None, save=0):
    return {"model": {"preset": None, "vocab_size": 256, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2,
                      "ffn_hidden": 64, "max_seq_len": 64},
            "parallel": {"data": D},
            "data": {"kind": "chat", "path": path, "seq_len": 64, "packing": "first_fit", "document_mask": True,
                     "eod_token": 0},
            "train": {"global_batch": 4, "micro_batch": 2, "steps": steps, "decay_steps": 6, "lr": 3e-3, "warmup_steps": 1,
                      "log_interval": 1, "seed": 2, "save_interval": save, "resume": resume or "never"}}


def _train_body(cfg, run_dir):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    losses = trainer.run()
    return losses, [r["valid_tokens"] for r in trainer.history]


def test_chat_records_train_and_resume_at_another_D_exactly(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _chat_records()))
    whole, valid = run_on_ranks(2, _train_body, _chat_config(str(path), D=2), str(tmp_path / "whole"), timeout=300)[0]
    assert whole[-1] < whole[0] and all(0 < v < 4 * 64 for v in valid), (whole, valid)
    run_on_ranks(2, _train_body, _chat_config(str(path), D=2, steps=3, save=3), str(tmp_path / "half"), timeout=300)
    resumed, rvalid = run_on_ranks(1, _train_body, _chat_config(str(path), D=1, resume=str(tmp_path / "half")),
                                   str(tmp_path / "resumed"), timeout=300)[0]
    assert rvalid == valid[3:]                                     # the same targets of the same batches
    np.testing.assert_allclose(resumed, whole[3:], rtol=1e-5)


def test_bad_record_data_is_refused_before_launch(tmp_path):
    path = _write(tmp_path, "parquet")
    base = {"model": {"preset": "tiny"}, "data": {"kind": "hf", "path": path, "seq_len": 32}}

    def refused(data, match):
        with pytest.raises(ConfigError, match=match):
            resolve_config({**base, "data": {**base["data"], **data}}, world_size=1)

    refused({"hf_text_field": "body"}, "hf_text_field='body'.*fields: \\['n', 'text'\\]")
    refused({"hf_split": "test"}, "hf_split='test'")
    refused({"path": str(tmp_path / "nowhere")}, "does not exist")
    refused({"document_mask": True}, "data.packing=none")
    refused({"val_fraction": 0.1}, "no validation part")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    refused({"path": str(empty)}, "holds no record")
    resolve_config(base, world_size=1)                             # the good one passes


def _hf_config(path, D, streaming):
    cfg = _chat_config(path, D=D, steps=3)
    cfg["data"] = {"kind": "hf", "path": path, "seq_len": 64, "packing": "first_fit", "document_mask": True,
                   "hf_streaming": streaming}
    return cfg


def test_hf_data_trains_the_same_streamed_at_D2_as_read_at_D1(tmp_path):
    path = _write(tmp_path, "parquet")
    one = run_on_ranks(1, _train_body, _hf_config(path, 1, False), str(tmp_path / "one"), timeout=300)[0]
    two = run_on_ranks(2, _train_body, _hf_config(path, 2, True), str(tmp_path / "two"), timeout=300)[0]
    assert one[1] == two[1] and all(v > 0 for v in one[1])
    np.testing.assert_allclose(two[0], one[0], rtol=1e-5)


def test_a_tokenizer_folder_s_chat_template_renders_and_masks_the_answers(tmp_path):
    """A ChatML template in a transformers tokenizer folder: the rendering is the template's, and the
    trained tokens are exactly each answer with its end marker."""
    pytest.importorskip("transformers")
    from gridshard.data.chat import TemplateTokenizer
    from gridshard.data.tokenizer import train_bpe

    tok = train_bpe(["what is two plus two four system be brief"] * 20, 300)
    tok.tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    t = TemplateTokenizer(str(tmp_path))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"},
            {"role": "assistant", "content": "four"}, {"role": "user", "content": "two plus two"},
            {"role": "assistant", "content": "four"}]
    ids, trained = render(msgs, t, eod=t.eos_id)
    assert t.tok.decode(ids[:-1].tolist()) == t.tok.apply_chat_template(msgs, tokenize=False)
    assert t.tok.decode(ids[trained].tolist()) == "four<|im_end|>\nfour<|im_end|>\n"
    assert ids[-1] == t.eos_id and not trained[-1]
