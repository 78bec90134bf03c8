"""``train.zero3_host_memory`` (issue 23, :mod:`gridshard.zero.pages`): ZeRO-3's memory outside
glibc's heap on a Linux CPU, the default there (unset → pages for ZeRO-3 on a Linux CPU).

* One process (D = 1): released buffers leave the resident set and read zeros; the long-lived
  chunks and AdamW's moments are carved from one arena of the documented size, AdamW steps in it,
  and memory accounting counts each carved view once.
* D = 2 ZeRO-3, 2 micro-batches, 2 steps: default (pages) and heap trainers in the same processes give
  bit-identical losses, norms and parameter chunks; the staging pool holds at most its 2 + 3
  slots of the largest unit, resident; the held bytes still equal the formula; the heap is
  trimmed as each backward reaches its first layers.
* Checkpoints (wide): a pages run saved at step 3 resumes bit for bit, under pages and heap.
* The config: explicit pages refused for ZeRO ≠ 3, a warning and no effect off a Linux CPU; the
  default resolves to pages exactly where they act and never warns nor is refused.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from gridshard.checkpoint.files import checkpoints_root
from gridshard.checkpoint.reader import read_checkpoint
from gridshard.engine import Trainer
from gridshard.engine.memory_meter import model_state_tensor_bytes, rss_now
from gridshard.engine.optim import build_optimizer
from gridshard.errors import ConfigError
from gridshard.mesh import Axis
from gridshard.testing import run_on_ranks
from gridshard.theory.memory import model_state_bytes
from gridshard.zero import build_reducer
from gridshard.zero.data_parallel import MAX_IN_FLIGHT
from gridshard.zero.gather import TRIMMED_LAYERS
from gridshard.zero.pages import ALIGN, ChunkArena, FlatPages, host_pages_in_effect, host_pages_note

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings: Linux")

MODEL = {"preset": None, "vocab_size": 260, "hidden": 48, "layers": 2, "heads": 4, "kv_heads": 2,
         "ffn_hidden": 120, "max_seq_len": 64, "tie_embeddings": True}


def _cfg(D, memory, **train):
    return {"model": MODEL, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 200_000},
            "parallel": {"data": D, "tensor": 1, "tensor_mode": "none"},
            "train": {"global_batch": 4, "micro_batch": 1, "steps": 3, "lr": 3e-3, "warmup_steps": 1,
                      "grad_clip": 0.5, "log_interval": 1, "seed": 5, "zero": 3, "zero3_host_memory": memory,
                      **train}}


def test_released_pages_leave_the_resident_set_and_read_zeros():
    pages = FlatPages(16 << 20, torch.float32, torch.device("cpu"))
    assert pages.mapped and pages.tensor.untyped_storage().nbytes() >= 64 << 20
    pages.tensor.fill_(1.0)
    before = rss_now()
    pages.release()
    assert before - rss_now() >= 0.9 * (64 << 20) and not pages.tensor.any()
    assert pages.as_dtype(torch.bfloat16).numel() == 32 << 20
    plain = FlatPages(100, torch.bfloat16, torch.device("cpu"), mapped=False)
    plain.release()
    assert plain.tensor.untyped_storage().nbytes() == 0
    plain.restore(zero=True)
    assert plain.tensor.untyped_storage().nbytes() == 200 and not plain.tensor.any()


def test_zero3_chunks_and_adam_moments_live_in_the_arena():
    """Arena bytes = Σ_units ⌈C·s_p⌉₆₄ + ⌈4C⌉₆₄ + 2·⌈C·s_m⌉₆₄ (fp32: s_p = s_m = 4); AdamW's
    state is the arena's views before and after a step (it allocates no moments), the step
    equals a plain AdamW's on the same parameters, and the accounting counts the optimizer's
    2·4 bytes per stepped element (+ its 4-byte step count) and 0 for released buffers.
    Without host pages (the default) there is no arena."""
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))   # noqa: E731
    model, ref, plain = make(), make(), make()
    ref.load_state_dict(model.state_dict())
    axis = Axis("data", 1, 0, (0,), None)
    assert build_reducer(plain, axis, zero=3, bucket_bytes=1 << 20, overlap=False).arena is None
    zero = build_reducer(model, axis, zero=3, bucket_bytes=1 << 20, overlap=False, host_pages=True)
    aligned = lambda n: -(-n // ALIGN) * ALIGN                                         # noqa: E731
    chunks = [u.layout.padded for u in zero.units]
    # per unit: parameter chunk, reduced chunk, exp_avg, exp_avg_sq, each C fp32 elements
    assert zero.arena is not None and zero.arena.used == sum(4 * aligned(4 * c) for c in chunks)
    assert ChunkArena.plan([(c, torch.float32) for c in chunks for _ in range(4)]) == zero.arena.used
    assert zero.staging is None                                       # D = 1: no collectives to stage
    opt = build_optimizer(model, 1e-2, 0.1, tensors=zero.optimizer_tensors())
    ref_opt = build_optimizer(ref, 1e-2, 0.1)
    x = torch.randn(4, 6)
    held = lambda: model_state_tensor_bytes(model, opt, zero.memory_tensors())          # noqa: E731
    assert held()["params"] == 0 and zero.released_tensors()
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().sum().backward()
        if m is model:
            zero.sync()
        o.step()
    zero.after_step()
    stepped = [t for g in opt.param_groups for t in g["params"]]
    for t in stepped:
        st = opt.state[t]
        assert all(zero.arena.byte_range(st[k]) is not None for k in ("exp_avg", "exp_avg_sq"))
        assert float(st["step"]) == 1.0
    with zero.gathered():
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
    assert held()["optimizer"] == 8 * sum(t.numel() for t in stepped) + 4 * len(stepped)      # + fp32 step counts


def _pair_body():
    """A heap and a default (unset: pages) ZeRO-3 trainer on the same ranks, one after the other:
    losses, norms, parameter chunks, held vs formula bytes, and the pages trainer's staging pool."""
    out = {}
    for memory in ("heap", None):
        trainer = Trainer(_cfg(2, memory, steps=2), progress=False)
        gathering, trims = trainer.reducer.gathering, []
        if gathering.trimmer is not None:              # count the heap trims (pages: in each backward)
            trim = gathering.trimmer
            gathering.trimmer = lambda pad: trims.append(pad) or trim(pad)
        losses = trainer.run()
        units = trainer.reducer.units
        blocks = [(tuple(p.shape), None if u.name == "root" else i) for i, u in enumerate(units) for p in u.params]
        st = model_state_bytes(blocks, 3, 2, trainer.mesh.data.rank)
        got = model_state_tensor_bytes(trainer.model, trainer.optimizer, trainer.reducer.memory_tensors())
        pool = trainer.reducer.staging
        out[memory or "pages"] = {"losses": losses, "norms": [h["grad_norm"] for h in trainer.history],
                       "chunks": [u.param_chunk.clone() for u in units],
                       "held": (sum(got.values()), st.held), "arena": trainer.reducer.arena is not None,
                       "pool": None if pool is None else (pool.nbytes, pool.nbytes_held(), dict(pool.free)),
                       "largest": max(u.layout.padded for u in units),
                       "trims": len(trims) if gathering.trimmer is not None else None,
                       "layers": sum(u.name != "root" for u in units)}
    return out


def test_pages_equal_heap_bit_for_bit_at_d2_with_a_resident_staging_pool():
    """D = 2 ZeRO-3, 2 micro-batches per rank, 2 steps (prefetch and sharded accumulation on):
    the default (pages on a Linux CPU) against explicit heap bit for bit; the pool is 2 send + (MAX_IN_FLIGHT + 1) receive slots of
    4·(largest unit's padded numel) bytes, all free again after the run, and what it made is
    at most that many slots (whole pages) — reused, not one per collective. Pages trim the heap
    as each micro-batch's backward reaches its first ``TRIMMED_LAYERS`` layers (min(layers,
    TRIMMED_LAYERS) · 2 · 2 calls of ``malloc_trim(0)``); heap has no trimmer."""
    for out in run_on_ranks(2, _pair_body, timeout=240):
        heap, pages = out["heap"], out["pages"]
        assert heap["losses"] == pages["losses"] and heap["norms"] == pages["norms"]
        assert all(torch.equal(a, b) for a, b in zip(heap["chunks"], pages["chunks"]))
        assert not heap["arena"] and heap["pool"] is None and pages["arena"]
        assert heap["trims"] is None and pages["trims"] == min(pages["layers"], TRIMMED_LAYERS) * 2 * 2 > 0
        for memory in (heap, pages):
            assert memory["held"][0] == memory["held"][1], memory["held"]
        nbytes, held, free = pages["pool"]
        assert nbytes == 4 * pages["largest"]
        assert sorted(free["gather"]) == [0, 1] and sorted(free["reduce"]) == list(range(MAX_IN_FLIGHT + 1))
        page = os.sysconf("SC_PAGE_SIZE")
        assert 0 < held <= (2 + MAX_IN_FLIGHT + 1) * -(-nbytes // page) * page, (held, nbytes)


def _ck_body(cfg, run_dir):
    losses = Trainer(cfg, run_dir=run_dir, progress=False).run()
    return losses if dist.get_rank() == 0 else None


@pytest.mark.wide
def test_pages_checkpoint_resumes_bit_for_bit_under_pages_and_heap(tmp_path):
    """A pages run (D = 2, 6 steps, saved at 3) resumed at step 3 with pages and with heap
    continues the uninterrupted run bit for bit (losses and the final checkpoint): the AdamW
    moments in the arena are saved and loaded like torch's own."""
    cfg = lambda memory, **more: _cfg(2, memory, steps=6, save_interval=3, **more)      # noqa: E731
    full = run_on_ranks(2, _ck_body, cfg("pages"), str(tmp_path / "full"), timeout=240)[0]
    step3 = os.path.join(checkpoints_root(str(tmp_path / "full")), "step_3")
    final = lambda name: read_checkpoint(os.path.join(checkpoints_root(str(tmp_path / name)), "step_6"))[1]  # noqa
    for memory in ("pages", "heap"):
        again = run_on_ranks(2, _ck_body, cfg(memory, resume=step3), str(tmp_path / memory), timeout=240)[0]
        assert again == full[3:], (memory, again, full)
        assert all(torch.equal(a, b) for a, b in zip(final(memory).values(), final("full").values())), memory


def test_pages_are_refused_below_zero3_and_say_they_do_nothing_off_a_linux_cpu():
    from gridshard.config import resolve_config

    with pytest.raises(ConfigError, match=r"train.zero3_host_memory='pages' is invalid.*train.zero=2.*Fix"):
        resolve_config(_cfg(2, "pages", zero=2), world_size=2)
    resolve_config(_cfg(2, "pages"), world_size=2)
    assert "changes nothing" in host_pages_note(torch.device("cuda"))


def test_the_default_is_pages_exactly_where_they_act_and_never_warns():
    """Unset → pages for ZeRO-3 on a Linux CPU only; explicit heap never; explicit pages on CUDA
    resolves to heap with one warning from the composer, the default there none; the default is
    accepted at every stage."""
    import types
    import warnings

    from gridshard.config import resolve_config
    from gridshard.engine.job import _host_pages

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert host_pages_in_effect(None, 3, cpu) and host_pages_in_effect("pages", 3, cpu)
    assert not any(host_pages_in_effect(None, stage, cpu) for stage in (0, 1, 2))
    assert not host_pages_in_effect("heap", 3, cpu)
    assert not host_pages_in_effect(None, 3, cuda) and not host_pages_in_effect("pages", 3, cuda)
    for zero in (0, 1, 2, 3):
        assert resolve_config(_cfg(2, None, zero=zero), world_size=2).train.zero3_host_memory is None
    job = lambda setting, device: types.SimpleNamespace(                                 # noqa: E731
        cfg=types.SimpleNamespace(train=types.SimpleNamespace(zero3_host_memory=setting, zero=3)),
        device=device, rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _host_pages(job(None, cpu)) and not _host_pages(job(None, cuda))
        assert not _host_pages(job("heap", cpu))
        assert not caught
        assert not _host_pages(job("pages", cuda))
    assert len(caught) == 1 and "changes nothing" in str(caught[0].message)
