"""Packed windows with document masks (issue 41): the windows and ids of gridshard.data.packing,
and the model on a packed batch against each document run alone, in one process."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gridshard.data.batches import BatchPlan
from gridshard.data.packing import Packer, document_starts, first_fit
from gridshard.errors import ConfigError
from gridshard.models.llama import ModelConfig, Transformer
from gridshard.nn.documents import attention_mask, blocks_meet, document_positions

EOD = 10


def _stream(lengths, seed=0):
    """Documents of the given lengths (each ends with EOD), random bytes 32..126 otherwise."""
    g = np.random.default_rng(seed)
    docs = [np.append(g.integers(32, 127, n - 1), EOD) for n in lengths]
    return np.concatenate(docs).astype(np.uint8)


def test_document_ids_positions_and_mask():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    m = attention_mask(docs, docs)[:, 0]
    want = (docs[:, :, None] == docs[:, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(m, want) and m[0, 3].tolist() == [False, False, True, True, False, False]
    assert torch.equal(attention_mask(docs[1:], docs[1:])[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    assert blocks_meet(docs, (0, 2), (2, 4))              # row 1 is one document
    assert not blocks_meet(docs[:1], (0, 2), (2, 4)) and blocks_meet(docs[:1], (2, 4), (4, 6))


def test_first_fit_places_every_document_once_in_the_first_window_with_room():
    starts = np.array([0, 5, 7, 20, 23])                  # documents of 5, 2, 13 (cut 8 + 5), 3, 4 tokens
    bins = first_fit(starts, 27, 8)
    assert bins == [[(0, 5), (5, 7)], [(7, 15)], [(15, 20), (20, 23)], [(23, 27)]]
    pieces = sorted(r for b in bins for r in b)
    assert pieces[0][0] == 0 and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])) and pieces[-1][1] == 27


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_packed_windows_ignore_cross_document_and_padding_targets(packing):
    toks = _stream([3, 9, 2, 14, 5, 7, 4] * 6)
    starts = document_starts(toks, EOD)
    assert starts[:4].tolist() == [0, 3, 12, 14]
    plan = BatchPlan(toks, 8, 8, 2, 2, 1, 3, 256, None, packer=Packer(toks, 8, packing, starts, True, pad=EOD))
    micro, n_valid = plan.step_batches(5)
    assert len(micro) == 2 and all(len(mb) == 3 for mb in micro)
    counted = 0
    for tokens, targets, docs in micro:
        assert tokens.shape == targets.shape == docs.shape == (2, 8)
        for r in range(2):
            for t in range(8):
                last_of_doc = t == 7 or docs[r, t + 1] != docs[r, t]
                ends = bool(tokens[r, t] == EOD)
                # a target is ignored exactly where the next token starts another document (or is padding)
                if targets[r, t] == -100:
                    assert ends or packing == "first_fit"
                else:
                    assert not (ends and not last_of_doc) and (t == 7 or docs[r, t + 1] == docs[r, t])
                    counted += 1
    full = BatchPlan(toks, 8, 8, 2, 1, 0, 3, 256, None, packer=Packer(toks, 8, packing, starts, True, pad=EOD))
    assert full.step_batches(5)[1] == n_valid                  # N is the whole global batch's, at any D
    assert counted < n_valid


def test_a_stream_without_boundaries_is_refused():
    with pytest.raises(ConfigError, match="data.eod_token"):
        document_starts(np.zeros(10, np.uint8), None)


def _model(seed=0):
    cfg = ModelConfig(vocab_size=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64, max_seq_len=64)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def test_a_packed_window_gives_each_document_its_own_logits_and_loss():
    """The issue's first criterion: every document of a packed, document-masked batch has the
    logits and loss it has alone (fp32, grouped-query heads)."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    lengths = [[5, 11, 3, 13], [32], [1, 30, 1]]
    tokens = torch.randint(0, 128, (3, 32), generator=g)
    targets = torch.randint(0, 128, (3, 32), generator=g)
    docs = torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in lengths])
    logits = model(tokens, documents=docs)
    for r, row in enumerate(lengths):
        at = 0
        for n in row:
            alone = model(tokens[r:r + 1, at:at + n])
            torch.testing.assert_close(logits[r:r + 1, at:at + n], alone, rtol=0, atol=1e-5)
            torch.testing.assert_close(F.cross_entropy(logits[r, at:at + n], targets[r, at:at + n]),
                                       F.cross_entropy(alone[0], targets[r, at:at + n]), rtol=0, atol=1e-5)
            at += n
    whole = model(tokens[1:2])                                 # one document: plain causal attention
    torch.testing.assert_close(logits[1:2], whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_memory_model_prices_the_document_tables_and_mask(recompute, precision):
    """What the layers keep on packed windows equals the formula (theory.memory.document_mask_bytes):
    the per-token rotary tables replace the shared ones, and the one additive mask is saved by SDPA
    (none) or held by the recomputed regions' inputs (selective, full: alive, but not a saved tensor)."""
    import contextlib

    from gridshard.engine.memory_meter import SavedTensorMeter
    from gridshard.parallel.recompute import apply_recompute
    from gridshard.theory import memory as M

    model = _model()
    apply_recompute(model, recompute)
    B, S = 3, 32
    tokens = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 5 + [1] * 11 + [2] * 16] * B)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with SavedTensorMeter(exclude=model.parameters()) as meter, autocast:
        model(tokens, documents=docs)
    formula = M.activation_bytes(model.cfg, B, S, recompute=recompute, precision=precision, documents=True)
    e = 2 if precision == "bf16" else 4
    mask = B * S * S * e
    assert formula.documents == 2 * B * S * model.cfg.head_dim * e + mask and formula.rope_tables == 0
    head = formula.head_and_loss                               # the model's forward alone: no loss
    assert meter.bytes == formula.total - head - (0 if recompute == "none" else mask)
