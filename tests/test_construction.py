"""Construction, not injection.

* ``parallelize`` hands its options to the layers it builds as constructor arguments: each 1D
  column layer already holds ``overlap_input_grad`` when its constructor returns, each 2D layer
  that gathers vectors the context's ``GatheredVectors`` (nothing is set on the layers after);
  a plan that names an attribute or children a module lacks is an error, not a silent skip.
* ``apply_recompute(model, "full")`` leaves every decoder layer's ``forward`` its class's, yet
  recomputes it in backward (the layer's modules are entered twice, the gradients are bit-identical to
  no recompute), and another owner's hook on the layer (ZeRO-3's kind) runs once per forward,
  never again inside backward.
"""
import pytest
import torch

from gridshard.testing import run_on_ranks


def _tiny():
    from gridshard.models import ModelConfig, Transformer

    return Transformer(ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64,
                                   max_seq_len=16))


def _record_after_init(cls, attribute, seen):
    """Patch ``cls.__init__`` to record ``attribute`` of every instance as its constructor left it."""
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self, getattr(self, attribute)))

    cls.__init__ = init
    return lambda: setattr(cls, "__init__", original)


def _options_at_construction():
    from gridshard import build_mesh, parallelize
    from gridshard.errors import LayoutError
    from gridshard.tensor.tp1d.linear import ColumnParallelLinear
    from gridshard.tensor.tp2d.linear import Linear2D
    from gridshard.tensor.tp2d.norm import RMSNorm2D
    from gridshard.parallel.plan import LLAMA_PLAN

    seen = []
    restore = _record_after_init(ColumnParallelLinear, "overlap_input_grad", seen)
    try:
        with torch.device("meta"):
            model = _tiny()
        model = parallelize(model, build_mesh(1, 1, 1, "1d"), device="cpu", overlap_input_grad=False)
    finally:
        restore()
    columns = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
    assert len(columns) == 2 * 5 + 1 and {id(m) for m, _ in seen} == {id(m) for m in columns}
    assert all(value is False and m.overlap_input_grad is False for m, value in seen)

    seen = []
    restores = [_record_after_init(cls, "vector_cache", seen) for cls in (Linear2D, RMSNorm2D)]
    try:
        with torch.device("meta"):
            model = _tiny()
        model = parallelize(model, build_mesh(1, 1, 1, "2d"), device="cpu")
    finally:
        for restore in restores:
            restore()
    cache = model.parallel_context.vector_cache
    gathering = [m for m in model.modules() if isinstance(m, (Linear2D, RMSNorm2D))]
    assert len(gathering) == 2 * 9 + 2 and {id(m) for m, _ in seen} == {id(m) for m in gathering}
    assert all(value is cache and m.vector_cache is cache for m, value in seen)

    with torch.device("meta"):
        model = _tiny()
    with pytest.raises(LayoutError, match=r"has no 'num_key_value_groups'.*Fix: set the plan's kv_group_attr"):
        parallelize(model, build_mesh(1, 1, 1, "1d"), LLAMA_PLAN.with_rules({}, kv_group_attr="num_key_value_groups"),
                    device="cpu")
    with torch.device("meta"):
        model = _tiny()
    with pytest.raises(LayoutError, match=r"shared_inputs name children .* which has no \['w_proj'\]"):
        parallelize(model, build_mesh(1, 1, 1, "1d"),
                    LLAMA_PLAN.with_rules({}, shared_inputs={"layers.*.mlp": ("gate_proj", "w_proj")}), device="cpu")
    return True


def test_parallelize_passes_options_to_constructors():
    assert all(run_on_ranks(1, _options_at_construction))


def _grads_and_calls(recompute: str):
    from gridshard.parallel.recompute import apply_recompute

    torch.manual_seed(0)
    model = _tiny()
    apply_recompute(model, recompute)
    mlp_calls, layer_hook_calls = [0], [0]
    for layer in model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: mlp_calls.__setitem__(0, mlp_calls[0] + 1))
        layer.register_forward_hook(lambda *_: layer_hook_calls.__setitem__(0, layer_hook_calls[0] + 1))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens).logsumexp(-1).mean().backward()
    return model, [p.grad for p in model.parameters()], mlp_calls[0], layer_hook_calls[0]


def test_full_recompute_keeps_forward_and_recomputes():
    _, plain_grads, plain_mlp, plain_hooks = _grads_and_calls("none")
    model, grads, mlp, hooks = _grads_and_calls("full")
    for layer in model.layers:
        assert "forward" not in vars(layer) and layer.forward.__func__ is type(layer).forward
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert (plain_mlp, mlp) == (2, 4)                  # every layer's MLP again in backward
    assert plain_hooks == hooks == 2                   # the layer's own hooks: once per forward
