"""``train.compile``: each decoder layer's forward under ``torch.compile`` gives the eager
run's losses (relative 1e-5) and parameters, on one device and with 1D tensor parallelism
(whose collectives are graph breaks that run eagerly: the ledger's calls are unchanged), and
(wide) with context parallelism at C = 2, ring and all-to-all, gridshard's and a Hugging Face Llama,
and the ring on packed windows with document masks.
Nothing compiles again after the first step (``torch._dynamo.config.error_on_recompile`` from the
second step on: a recompile fails the run), and no code object reaches torch's recompile limit in the
first (``fail_on_recompile_limit_hit``: a frame past the limit would silently run eagerly from then on)."""
import pytest
import torch
import torch.distributed as dist

from gridshard.engine import Trainer
from gridshard.parallel import gathered_state_dict
from gridshard.testing import run_on_ranks

BASE = {"model": {"preset": "tiny"}, "data": {"kind": "stdlib", "seq_len": 32, "max_bytes": 100_000},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 4, "lr": 3e-3, "warmup_steps": 1, "log_interval": 1,
                  "seed": 3, "eval_interval": 0}}


def _cfg(T, mode, sp, compile_, micro_batch=2, depth=1):
    model = {"preset": "tiny", "kv_heads": 2} if T >= 4 else BASE["model"]      # 2D, 2.5D, 3D: grouped-query
    return {**BASE, "model": model, "parallel": {"data": 1, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp,
                                 "tensor_depth": depth},
            "train": {**BASE["train"], "compile": compile_, "global_batch": 2 * micro_batch,
                      "micro_batch": micro_batch}}


def _body(cfg):
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = cfg["train"]["compile"]
    trainer = Trainer(cfg, progress=False)
    first_step = trainer.step

    def step(k):                       # after the first step nothing may compile again (issue 39)
        try:
            return first_step(k)
        finally:
            torch._dynamo.config.error_on_recompile = cfg["train"]["compile"]

    trainer.step = step
    try:
        losses = trainer.run()
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.config.fail_on_recompile_limit_hit = False
    calls = {k: v.count for k, v in trainer.ledger.entries.items() if k[1] != "world"}
    state = gathered_state_dict(trainer.model)
    return (losses, state, calls) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("layout", [(1, "none", False), (2, "1d", True),
                                    pytest.param((4, "2d", False), marks=pytest.mark.wide),
                                    pytest.param((8, "2.5d", False), marks=pytest.mark.wide),
                                    pytest.param((8, "3d", False), marks=pytest.mark.wide)],
                         ids=["T1", "T2-1d-SP", "T4-2d", "T8-2.5d", "T8-3d"])
def test_compiled_layers_train_like_eager(layout):
    """(wide) 2D at q = 2, 2.5D at q = 2, d = 2 and 3D at q = 2 (micro-batch 4: q², d·q and q² batch
    blocks; 4 heads over 2 kv heads): the layer's collectives and the gathered-vector window break its
    graph; before the collective wrappers were skipped (``collectives.compile_eagerly``) their frames
    hit the recompile limit in the first step at 3D. The 3D case is the compiled 3D check (eager 3D
    against one process: tests/test_tp3d_model.py)."""
    T, mode, sp = layout
    mb, depth = (2, 1) if T < 4 else (4, 2 if mode == "2.5d" else 1)
    eager, compiled = (run_on_ranks(T, _body, _cfg(T, mode, sp, c, mb, depth), timeout=600)[0]
                       for c in (False, True))
    for a, b in zip(eager[0], compiled[0]):
        assert abs(a - b) <= 1e-5 * abs(a), (eager[0], compiled[0])
    assert len(eager[0]) == len(compiled[0]) == BASE["train"]["steps"]
    # parameters as a whole (AdamW turns rounding-level gradient differences of near-zero
    # gradient elements into differences of a few lr·1e-3 in single elements)
    for k, v in eager[1].items():
        rel = float((compiled[1][k] - v).norm() / v.norm())
        assert rel <= 1e-4, (k, rel)                  # as the layout-equivalence tests
    assert compiled[2] == eager[2]                 # the same collectives, in number, as eager


@pytest.mark.wide
@pytest.mark.parametrize("model,mode", [("llama", "ring"), ("llama", "all_to_all"), ("hf", "ring"),
                                        ("llama+documents", "ring")])
def test_compiled_layers_train_like_eager_at_context_2(model, mode, tmp_path):
    """Context parallelism (C = 2, grouped-query attention; gridshard's Llama, and a Hugging Face
    Llama whose attention reaches the ring through transformers' attention interface): the ring's
    isend/irecv (or the all-to-alls) and their ledger records are graph breaks that run eagerly, as
    the tensor-parallel collectives; the compiled run gives eager's losses (1e-5 relative) and the
    same collectives."""
    import json

    spec = {"preset": None, "vocab_size": 256, "hidden": 64, "layers": 2, "heads": 8, "kv_heads": 4,
            "ffn_hidden": 128, "max_seq_len": 32}
    if model == "hf":
        path = tmp_path / "config.json"
        path.write_text(json.dumps({"model_type": "llama", "vocab_size": 259, "hidden_size": 64,
                                    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
                                    "num_key_value_heads": 4, "max_position_embeddings": 32}))
        spec = {"hf_config": str(path)}
    data = BASE["data"]
    if model == "llama+documents":                   # packed windows: the ring reads the ids every layer
        data = {**data, "packing": "first_fit", "document_mask": True, "eod_token": 32}
    cfgs = [{**BASE, "model": spec, "data": data, "parallel": {"data": 1, "context": 2, "context_mode": mode},
             "train": {**BASE["train"], "compile": c}} for c in (False, True)]
    eager, compiled = (run_on_ranks(2, _body, cfg, timeout=600)[0] for cfg in cfgs)
    rel = max(abs(a - b) / abs(a) for a, b in zip(eager[0], compiled[0]))
    print(f"C2 {model} {mode}: compiled vs eager loss {rel:.1e}")
    assert rel <= 1e-5, (eager[0], compiled[0])
    assert len(eager[0]) == len(compiled[0]) == BASE["train"]["steps"]
    for k, v in eager[1].items():
        rel = float((compiled[1][k] - v).norm() / v.norm())
        assert rel <= 1e-4, (k, rel)
    assert compiled[2] == eager[2] and any(k[1] == "context" for k in eager[2])
