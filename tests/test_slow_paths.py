"""Issue 27's slow paths, fixed without changing a number (each test fails on the slow form):

* clipping scales gradients with one ``torch._foreach_mul_`` per (device, dtype) group, bit for
  bit the per-tensor ``mul_``;
* the RoPE tables are built once per (length, head_dim, theta, device, dtype) per model, not
  every forward, and are not part of the state dict; generation slices the model's one table
  of the window instead of building one per decoded token;
* optimizer offload: host buffers (values and gradient staging) ask for pinned memory when the
  device tensors are on CUDA, a step waits on one CUDA event instead of a device-wide
  ``torch.cuda.synchronize``, and the host step is torch's fused AdamW (CUDA faked on CPU:
  what only a GPU shows is written in :mod:`gridshard.zero.offload`);
* input batches are pinned before a non-blocking upload to CUDA, untouched on CPU.
"""
from __future__ import annotations

import torch

from gridshard.device import batch_to_device
from gridshard.engine.clip import clip_gradients
from gridshard.models import rope as rope_module
from gridshard.models.llama import ModelConfig, Transformer
from gridshard.zero import offload as offload_module
from gridshard.zero.offload import HostAdamW


# ---- clipping ------------------------------------------------------------------------------
def _params_with_grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes_dtypes = [((5, 3), torch.float32), ((7,), torch.bfloat16), ((4, 4), torch.float32),
                     ((2,), torch.float32), ((3, 2), torch.bfloat16)]
    params = []
    for shape, dtype in shapes_dtypes:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=g).to(dtype)
        params.append(p)
    params[3].grad = None                      # a parameter without a gradient is skipped
    return params


def test_clipping_is_one_foreach_mul_per_dtype_group_bit_for_bit(monkeypatch):
    params = _params_with_grads(0)
    norm = torch.tensor(7.3, dtype=torch.float64)
    coef = (1.0 / (norm + 1e-6)).clamp(max=1.0)
    expected = [None if p.grad is None else p.grad.clone().mul_(coef.to(p.grad.dtype)) for p in params]
    calls = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda ts, s: (calls.append(len(ts)), real(ts, s))[1])
    clip_gradients(params, norm, max_norm=1.0)
    assert calls == [2, 2]                     # fp32 group, bf16 group (2 gradients each)
    for p, e in zip(params, expected):
        assert (p.grad is None and e is None) or torch.equal(p.grad, e)


# ---- RoPE tables ---------------------------------------------------------------------------
def _count_table_builds(monkeypatch) -> list:
    built = []
    real = rope_module.rope_tables

    def counting(*args, **kwargs):
        built.append(args[:2])
        return real(*args, **kwargs)

    monkeypatch.setattr(rope_module, "rope_tables", counting)
    import gridshard.models.llama as llama_module
    monkeypatch.setattr(llama_module, "rope_tables", counting, raising=False)   # the pre-cache import
    return built, real


def test_rope_tables_built_once_per_length_equal_and_not_saved(monkeypatch):
    built, fresh_tables = _count_table_builds(monkeypatch)
    cfg = ModelConfig(vocab_size=32, hidden=16, layers=2, heads=2, ffn_hidden=24, max_seq_len=16)
    model = Transformer(cfg)
    keys_before = set(model.state_dict())
    tokens = torch.randint(0, 32, (2, 8))
    first = model(tokens)
    again = model(tokens)
    assert built == [(8, cfg.head_dim)]                      # the second forward reused the tables
    assert torch.equal(first, again)
    cos, sin = model.layer_inputs(first, 8)
    want_cos, want_sin = fresh_tables(8, cfg.head_dim, cfg.rope_theta)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    model(tokens[:, :4])
    assert built == [(8, cfg.head_dim), (4, cfg.head_dim)]    # a new length: a new entry
    assert set(model.state_dict()) == keys_before             # checkpoints unchanged
    assert not any("rope" in n for n, _ in model.named_buffers())


def test_cached_rope_tables_equal_fresh_ones_and_survive_inference_mode():
    cfg = ModelConfig(vocab_size=32, hidden=16, layers=1, heads=2, ffn_hidden=24, max_seq_len=16)
    model = Transformer(cfg)
    tokens = torch.randint(0, 32, (2, 8))
    with torch.inference_mode():
        model(tokens)                                         # tables first built here
    cos, sin = model.layer_inputs(torch.zeros(1), 8)
    fresh = rope_module.rope_tables(8, cfg.head_dim, cfg.rope_theta)
    assert torch.equal(cos, fresh[0]) and torch.equal(sin, fresh[1])
    model(tokens).float().pow(2).mean().backward()            # saved for backward: not inference tensors


def test_generation_builds_the_rope_table_once_per_call_with_unchanged_output(monkeypatch):
    """``generate``'s cached decoder slices the model's one table of the window (it built a new
    table at every decoded token); the logits equal, bit for bit, those with a table of pos + n
    rows built at each step (the former form)."""
    from gridshard import generate as gen_module

    cfg = ModelConfig(vocab_size=41, hidden=16, layers=2, heads=4, kv_heads=2, ffn_hidden=24, max_seq_len=24)
    torch.manual_seed(3)
    model = Transformer(cfg).eval()
    prompt = torch.randint(0, 41, (1, 5))

    def decode(dec):
        out = [dec.step(prompt)]
        out += [dec.step(prompt[:, i:i + 1]) for i in range(4)]
        return torch.cat(out, 1)

    built, _ = _count_table_builds(monkeypatch)
    ids = gen_module.generate_ids(model, prompt[0].tolist(), 12, temperature=0.0)
    assert built == [(cfg.max_seq_len, cfg.head_dim)]         # one table for the whole call
    got = decode(gen_module.CachedDecoder(model))
    assert built == [(cfg.max_seq_len, cfg.head_dim)]         # and reused by the next decoder

    def fresh_rows(self, n, device):                          # the former per-step table
        cos, sin = rope_module.rope_tables(self.pos + n, cfg.head_dim, cfg.rope_theta, device)
        return cos[self.pos:], sin[self.pos:]

    monkeypatch.setattr(gen_module.CachedDecoder, "_rope_rows", fresh_rows)
    assert torch.equal(got, decode(gen_module.CachedDecoder(model)))
    assert gen_module.generate_ids(model, prompt[0].tolist(), 12, temperature=0.0) == ids


# ---- optimizer offload ---------------------------------------------------------------------
class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on CUDA (for the offload's decisions only)."""

    @property
    def is_cuda(self):
        return True


class _FakeEvent:
    log: list = []

    def record(self):
        self.log.append("record")

    def synchronize(self):
        self.log.append("synchronize")


def test_offload_pins_host_buffers_and_waits_on_one_event_per_step(monkeypatch):
    pinned_requests = []
    real_zeros, real_empty = torch.zeros, torch.empty

    def allocation(real):
        def allocate(*args, pin_memory=False, **kwargs):
            pinned_requests.append(pin_memory)
            return real(*args, **kwargs)                       # a CPU-only build cannot pin
        return allocate

    monkeypatch.setattr(torch, "zeros", allocation(real_zeros))
    monkeypatch.setattr(torch, "empty", allocation(real_empty))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("a device-wide synchronize per offload step")))
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    torch.manual_seed(0)
    params = [torch.randn(5, 3).as_subclass(_FakeCudaTensor), torch.randn(7).as_subclass(_FakeCudaTensor)]
    opt = HostAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2)
    assert pinned_requests.count(True) >= 2 * len(params)     # a value and a gradient buffer each
    staging = {id(opt.copies[p].grad) for p in params}
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    assert _FakeEvent.log == ["record", "synchronize"] * 3
    assert {id(opt.copies[p].grad) for p in params} == staging  # the pinned staging is reused, not re-made
    assert opt.inner.defaults["fused"] is True                # the host step: fused, multi-threaded


def test_offload_pins_only_for_cuda_tensors_on_a_cuda_host(monkeypatch):
    fake_cuda, cpu = [torch.randn(3).as_subclass(_FakeCudaTensor)], [torch.randn(3)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not offload_module.pins_host_buffers(fake_cuda, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert offload_module.pins_host_buffers(fake_cuda, torch.device("cpu"))
    assert not offload_module.pins_host_buffers(cpu, torch.device("cpu"))


# ---- input batches -------------------------------------------------------------------------
def test_batches_pinned_only_for_a_cuda_upload(monkeypatch):
    tokens = torch.arange(6).view(2, 3)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: (pinned.append(self.shape), self)[1])
    assert batch_to_device(tokens, torch.device("cpu")) is tokens and pinned == []    # CPU: unchanged
    uploads = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False:
                        (uploads.append((torch.device(device).type, non_blocking)), self)[1])
    batch_to_device(tokens, torch.device("cuda", 0))
    assert pinned == [tokens.shape] and uploads == [("cuda", True)]
