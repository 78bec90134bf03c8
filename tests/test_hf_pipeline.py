"""A Hugging Face ``LlamaForCausalLM`` with pipeline parallelism (``model.hf_config`` with
``parallel.pipeline`` > 1): its stages run the model's own modules through
:class:`gridshard.models.hf_stages.LlamaStagePieces`, so

* the pieces composed over a whole model give Hugging Face's own logits bit for bit (one
  process; removing the RoPE or the causal mask from the pieces breaks it);
* 10 training steps (fp32, clipping active) at (D, P, T) with 1D+SP, 2D q=2 and P=4 give the
  one-process run's loss and gradient norm at every step within 1e-5 relative, tied and
  untied, with grouped-query attention (4 heads / 2 kv heads) and a vocabulary of 259 (not a
  multiple of T: padding is exercised). ``make test`` runs (1, 2, 2) 1D+SP tied; the other
  layouts are ``wide`` (``make test-all``);
* a checkpoint saved with pipeline stages resumes on one process (names do not depend on P;
  ``wide``), and a sliding-window family is refused before launch.
"""
import json

import pytest
import torch

from gridshard.testing.train_cache import train_on_ranks

transformers = pytest.importorskip("transformers")
RTOL = 1e-5
STEPS = 10


def _hf_json(tmp_path_factory, tied):
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 259, "hidden_size": 64,
                                "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "max_position_embeddings": 32,
                                "tie_word_embeddings": tied}))
    return str(path)


def _cfg(path, D, P, T, mode, sp=False, schedule="1f1b", V=1):
    return {"model": {"hf_config": path}, "data": {"kind": "stdlib", "seq_len": 16, "max_bytes": 100_000},
            "parallel": {"data": D, "pipeline": P, "tensor": T, "tensor_mode": mode, "sequence_parallel": sp,
                         "pipeline_schedule": schedule, "virtual_stages": V},
            "train": {"global_batch": 8, "micro_batch": 2 if D == 1 else 1, "steps": STEPS, "lr": 3e-3,
                      "warmup_steps": 2, "grad_clip": 0.5, "log_interval": 1, "seed": 3}}


def _train(cfg, run_dir=None):
    from gridshard.engine import Trainer

    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    losses = trainer.run()
    return losses, [h["grad_norm"] for h in trainer.history]


def _run(cfg, run_dir=None):
    return train_on_ranks(_train, cfg, run_dir, timeout=300)[0]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """tied → (config.json path, lazily computed one-process (losses, grad norms))."""
    cache = {}

    def get(tied):
        if tied not in cache:
            path = _hf_json(tmp_path_factory, tied)
            cache[tied] = path, _run(_cfg(path, 1, 1, 1, "none"))
        return cache[tied]
    return get


def _assert_same_run(got, ref, name):
    (loss, norm), (ref_loss, ref_norm) = got, ref
    assert len(loss) == len(ref_loss) == STEPS and max(ref_norm) > 0.5, "clipping (0.5) must be active"
    for what, a, b in (("loss", loss, ref_loss), ("grad_norm", norm, ref_norm)):
        rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        assert rel <= RTOL, f"{name}: {what} differs from one process by {rel:.2e} relative ({a} vs {b})"


# name → (D, P, T, mode, sp, schedule, V, tied)
LAYOUTS = {
    "D1-P2-T2-1d-SP-tied": (1, 2, 2, "1d", True, "1f1b", 1, True),
    "D1-P2-T4-2d": (1, 2, 4, "2d", False, "1f1b", 1, False),
    "D1-P2-T4-2d-tied": (1, 2, 4, "2d", False, "1f1b", 1, True),
    "D2-P4-none": (2, 4, 1, "none", False, "1f1b", 1, False),
    "D1-P4-T2-1d-SP-tied-gpipe": (1, 4, 2, "1d", True, "gpipe", 1, True),
    "D1-P2-T2-1d-interleaved": (1, 2, 2, "1d", False, "interleaved_1f1b", 2, False),
}
DEFAULT = "D1-P2-T2-1d-SP-tied"


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == DEFAULT else pytest.mark.wide) for n in LAYOUTS])
def test_pipelined_hf_llama_equals_one_process(hf_runs, name):
    D, P, T, mode, sp, schedule, V, tied = LAYOUTS[name]
    path, ref = hf_runs(tied)
    _assert_same_run(_run(_cfg(path, D, P, T, mode, sp, schedule, V)), ref, name)


def test_pipelined_hf_llama_in_bf16_equals_one_process_in_bf16(tmp_path_factory):
    """bf16 storage: the residual stream a stage sends is the embedding's output, bf16 (its parameters'
    dtype). The stages declared it fp32, so the next stage read each bf16 send into an fp32 buffer, half
    of it garbage: gradient norms of 10⁴ where one process has 4, different at each run. Now the run at
    P = 2 is the one-process bf16 run (the same operations in the same order), and every stage checks
    its first output against what it declared (:func:`gridshard.pipeline.stage_module.check_declared_output`)."""
    path, runs = _hf_json(tmp_path_factory, False), {}
    for P in (1, 2):
        cfg = _cfg(path, 1, P, 1, "none")
        cfg["train"].update(precision="bf16", steps=3)
        runs[P] = _run(cfg)
    (loss, norm), (ref_loss, ref_norm) = runs[2], runs[1]
    for what, a, b in (("loss", loss, ref_loss), ("grad_norm", norm, ref_norm)):
        rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        assert len(a) == 3 and rel <= 1e-3, f"bf16 P=2: {what} differs from one process by {rel:.2e} ({a} vs {b})"


@pytest.mark.wide
def test_checkpoint_of_pipelined_hf_model_resumes_at_one_process(hf_runs, tmp_path):
    """Names do not depend on P: saved at (1, 2, 2) 1D+SP at step 5, resumed on one process,
    the remaining steps are the uninterrupted one-process run's."""
    path, (ref_loss, _) = hf_runs(True)
    saved = _cfg(path, 1, 2, 2, "1d", True)
    saved["train"]["save_interval"] = 5
    _run(saved, str(tmp_path / "p2"))
    resumed = _cfg(path, 1, 1, 1, "none")
    resumed["train"]["resume"] = str(tmp_path / "p2" / "checkpoints" / "step_5")
    loss, _ = _run(resumed, str(tmp_path / "p1"))
    assert len(loss) == STEPS - 5
    assert max(abs(x - y) / y for x, y in zip(loss, ref_loss[5:])) <= RTOL


class _WholeModelPieces:
    """The stage pieces over a whole Hugging Face model's modules."""

    def __init__(self, hf):
        from gridshard.models.hf_stages import LlamaStagePieces

        self.pieces = type("Pieces", (LlamaStagePieces,), {})()
        self.pieces.model, self.pieces.lm_head, self.pieces.config = hf.model, hf.lm_head, hf.config

    def forward(self, tokens):
        p = self.pieces
        x = p.embed(tokens)
        inputs = p.layer_inputs(x, tokens.shape[-1])
        for layer in p.model.layers:
            x = p.run_layer(layer, x, inputs)
        return p.head(x)


def test_stage_pieces_compose_to_hf_forward():
    """One description of the forward: the pieces a stage runs, composed over the whole model,
    are Hugging Face's own ``LlamaForCausalLM.forward`` (bit for bit)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gridshard.testing.inputs import randint

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(5)
    hf = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    tokens = randint(97, (2, 12), 0)
    with torch.no_grad():
        assert torch.equal(_WholeModelPieces(hf).forward(tokens), hf(input_ids=tokens, use_cache=False).logits)


def test_sliding_window_family_is_refused_before_launch(tmp_path):
    """Pipeline stages run Llama's causal forward: a sliding-window Mistral is refused by the
    config validation (before any process starts), with a fix; without the window it passes."""
    from gridshard.config import resolve_config
    from gridshard.errors import ConfigError

    fields = {"model_type": "mistral", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 32}
    cfg = _cfg(str(tmp_path / "config.json"), 1, 2, 1, "none")
    for sliding, refused in ((4096, True), (None, False)):
        (tmp_path / "config.json").write_text(json.dumps({**fields, "sliding_window": sliding}))
        if refused:
            with pytest.raises(ConfigError, match="sliding_window=4096.*Fix: parallel.pipeline=1"):
                resolve_config(cfg, world_size=2, cuda_available=False)
        else:
            resolve_config(cfg, world_size=2, cuda_available=False)
