"""Activation recompute: keep fewer activations for backward, compute them again instead.

``train.recompute``:

* ``none``: every activation a backward needs is kept — except SwiGLU's silu(g), which in every
  mode is computed again from g in backward (:func:`gridshard.nn.swiglu.swiglu`: the SwiGLU keeps
  g and u, as Megatron's fused ``bias_swiglu`` does; a pointwise op, no checkpoint region).
* ``full``: each decoder layer keeps only its input; in backward its forward runs again
  (``torch.utils.checkpoint``, non-reentrant) and then its backward. The layer's
  tensor-parallel *forward* collectives therefore run twice per step (forward and
  recomputation: the same ops in the same order on every rank, so no rank waits on another);
  the step's tensor-group bytes grow by those forward collectives, up to the last tensor backward
  needs (PyTorch stops the recomputation there: :func:`gridshard.tensor.tp1d.theory.block_recompute_comm`).
* ``selective``: the cheap, memory-heavy parts of each layer are recomputed, as Korthikanti
  et al. (2022) recompute the attention core and Megatron-core / torchtitan also the MLP
  activation (in gridshard's Llama that is so in every mode, above); the projections (the FLOPs)
  and the norms keep their activations. Exactly:

  - **attention core** (:meth:`gridshard.models.llama.Attention.core`: RoPE on q and k and the
    causal softmax attention) — kept: q, k, v as the projections made them (before RoPE) and
    the shared cos/sin tables; recomputed: rotated q and k and SDPA's saved tensors (the
    rotated q, k, v, its output and the log-sum-exp; an unfused softmax would keep its s×s
    probabilities here). The core's output stays kept by ``o_proj`` (its input).
  - **MLP activation** (silu(g)·u, :func:`gridshard.nn.swiglu.swiglu`) — kept: g = gate(x)
    and u = up(x); recomputed: silu(g) — as under ``none``, so nothing is switched on for it
    (the ViT's GELU, :class:`gridshard.models.vit.ViTLayer`, is a checkpoint region here). The
    product is ``down_proj``'s input, rebuilt (below).

  - **rebuildable saved tensors** (:mod:`gridshard.nn.rebuild`, :func:`rebuild_module`) — the
    outputs of both RMSNorms, which q|k|v and gate|up keep for their weight gradients, and the
    product silu(g)·u, which ``down_proj`` keeps, are not kept: the consumers keep recipes over
    tensors kept anyway (x̂ and w, or x, rstd and w; g and u) and backward rebuilds them, bit for
    bit, with one or two pointwise ops.

  Per layer that is the log-sum-exp (N·H_r·4 bytes), one f-wide tensor (the product) and the
  two norm outputs (R·e each) less than ``none``
  (:func:`gridshard.theory.memory.layer_saved_bytes`). All of it runs on the rank's own heads /
  MLP columns / blocks with no collective and no matmul, so nothing is communicated again —
  except under context parallelism (``parallel.context`` > 1), where the recomputed attention
  core runs its ring sends (or all-to-alls) again in backward, on every context rank in the same
  order (:mod:`gridshard.context`).
  (gridshard's Llama; a Hugging Face model takes ``full``.) The ViT (:mod:`gridshard.models.vit`)
  has the same two regions and no rebuilt tensors (its LayerNorm and GELU offer nothing): its
  attention core (full softmax attention, q, k, v kept; on the math SDPA backend its s×s
  probabilities are not kept) and its GELU, recomputed from its input u — which GELU and
  output.dense keep anyway (u and gelu(u)), so the MLP region saves no bytes there.

All three give exactly the same gradients as ``none`` (the recomputation and the rebuilds repeat
deterministic ops under the same autocast state; no dropout), which ``tests/test_recompute.py``
checks bit for bit in fp32 (and, with data parallelism, ZeRO-3, pipeline stages, in bf16: marked
``wide``). Under ``train.compile`` the rebuild offers nothing (:mod:`gridshard.nn.rebuild`).

How ``full`` is installed: nothing of the module is replaced (its ``forward`` stays its class's,
parameter names and state dicts are unchanged). A forward pre-hook opens PyTorch's non-reentrant
checkpoint region around the call (the generator behind ``torch.utils.checkpoint.checkpoint``
and the composable ``checkpoint`` of ``torch.distributed``) and a forward hook, registered first among the
forward hooks, closes it. Unlike the composable API, the recomputation runs the module's
``forward`` itself, not ``module(...)``: the hooks of other owners (ZeRO-3's gather and release,
:mod:`gridshard.zero.data_parallel`) run once per forward, as without recompute, and not again
inside backward (where a release would free the parameters the recomputed graph reads). The
``forward`` recomputed is the one the call ran — a compiled one under ``train.compile``
(:mod:`gridshard.parallel.compile`) — whichever of the two is applied first.
"""
from __future__ import annotations

import inspect

from torch import nn
from torch.utils.checkpoint import (_DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator,
                                    noop_context_fn)

from ..errors import LayoutError
from ..nn.rebuild import RebuildRegion
from .decoder_layers import decoder_layers

MODES = ("none", "full", "selective")

#: what ``selective`` turns on, in any module that has it: the attention core
#: (:class:`gridshard.models.llama.Attention`, :class:`gridshard.models.vit.ViTSelfAttention`) and
#: the MLP activation (:class:`gridshard.models.vit.ViTLayer`; the Llama's SwiGLU rebuilds silu(g)
#: in every mode, :func:`gridshard.nn.swiglu.swiglu`)
SELECTIVE_SWITCHES = ("recompute_core_in_backward", "recompute_activation_in_backward")


def _arguments_after_fn() -> list:
    """The positional values between ``fn`` and ``*args`` of ``_checkpoint_without_reentrant_generator``,
    by name (torch 2.13: preserve_rng_state, context_fn, determinism_check, debug, early_stop;
    older releases lack early_stop): ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``'s
    defaults. A parameter this does not know is an error, not a silent shift of the arguments."""
    values = {"preserve_rng_state": True, "context_fn": noop_context_fn,
              "determinism_check": _DEFAULT_DETERMINISM_MODE, "debug": False, "early_stop": True}
    leading = []
    for p in list(inspect.signature(_checkpoint_without_reentrant_generator).parameters.values())[1:]:
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        if p.name not in values:
            raise RuntimeError(f"recompute: this torch's checkpoint generator takes {p.name!r}, which gridshard does "
                               f"not know. Fix: use a torch release gridshard supports (pyproject.toml).")
        leading.append(values[p.name])
    return leading


def checkpoint_module(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward (non-reentrant checkpoint) through a pre-hook
    and a forward hook; the module itself is left as it is (module docstring)."""
    running = []                                # the open checkpoint region of the call in flight
    after_fn = _arguments_after_fn()

    def open_region(mod, args, kwargs):
        # torch.utils.checkpoint.checkpoint(use_reentrant=False)'s defaults: RNG state kept, no context,
        # the default determinism check, recomputation stopped early at the last tensor backward needs
        # (the call's tensors go in as the generator's own *args, so autograd saves them as the layer's
        # input, as torch.utils.checkpoint does; its leading parameters differ across torch versions)
        region = _checkpoint_without_reentrant_generator(mod.forward, *after_fn, *args, **kwargs)
        next(region)                            # saved tensors of the forward are packed from here
        running.append(region)

    def close_region(mod, args, output):
        if not running:
            return
        try:
            next(running.pop())                 # ... to here
        except StopIteration:
            return
        raise RuntimeError("recompute: the checkpoint region of a forward did not close")

    module.register_forward_pre_hook(open_region, with_kwargs=True)
    module.register_forward_hook(close_region, prepend=True, always_call=True)


#: what offers its output to a decoder layer's :class:`gridshard.nn.rebuild.RebuildRegion` under
#: ``selective``: the RMSNorms (:class:`gridshard.nn.norm.RMSNorm`, :class:`gridshard.tensor.tp2d.norm.RMSNorm2D`)
#: and the SwiGLU MLP (:class:`gridshard.models.llama.SwiGLUMLP`)
REBUILD_SWITCH = "rebuild_output_in_backward"


def rebuild_module(module: nn.Module) -> int:
    """Open a :class:`RebuildRegion` around every call of ``module`` (a forward pre-hook opens it,
    a forward hook registered first closes it, also when the forward raises) and let each
    submodule that can offer its output do so; returns how many offer (0: nothing installed)."""
    region = RebuildRegion()
    producers = [m for m in module.modules() if callable(getattr(m, REBUILD_SWITCH, None))]
    if not producers:
        return 0
    for m in producers:
        getattr(m, REBUILD_SWITCH)(region)
    module.register_forward_pre_hook(lambda mod, args: region.open(), prepend=True)
    module.register_forward_hook(lambda mod, args, out: region.close(), prepend=True, always_call=True)
    return len(producers)


def apply_recompute(model: nn.Module, mode: str) -> int:
    """Install ``mode`` on a (laid-out or plain) model; returns how many modules it wraps."""
    if mode not in MODES:
        raise LayoutError(f"train.recompute={mode!r} is not one of {MODES}. Fix: use one of them.")
    count = 0
    if mode == "full":
        for _, module in decoder_layers(model):
            checkpoint_module(module)
            count += 1
    elif mode == "selective":
        for module in model.modules():
            for switch in SELECTIVE_SWITCHES:
                if callable(getattr(module, switch, None)):
                    getattr(module, switch)()
                    count += 1
        if count == 0:
            raise LayoutError(f"train.recompute=selective recomputes the attention core and MLP activation of "
                              f"gridshard's models, and this {type(model).__name__} has neither. "
                              f"Fix: train.recompute=full.")
        for _, module in decoder_layers(model):
            rebuild_module(module)
    return count
