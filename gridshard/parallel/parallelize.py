"""``parallelize(model, mesh)``: one door from a plain model to a laid-out one.

Steps, all local to the rank (no collective runs before the first forward):

1. read the model's dimensions (gridshard ``ModelConfig`` or a Hugging Face config) and
   check that the mesh can lay them out — whole heads per rank, kv heads split or
   replicated, every parameterised module covered by the plan (the divisibility rules are
   :func:`gridshard.nn.shape_rules.layout_rules`, the config validator's) — raising one
   :class:`LayoutError` naming the module, the rule and a fix. The mesh's
   :class:`gridshard.job_layout.TensorMode` decides which layers to build, whether sequence
   parallelism is in effect and how kv heads are shared; each layer gets those facts as
   constructor arguments;
2. swap each planned module for the gridshard layer of the mesh's tensor mode
   (the scheme's :meth:`~gridshard.tensor_scheme.TensorScheme.build_layer`, ``gridshard/tensor/<mode>/build.py``),
   built on the meta device (3D: on ``mesh.cube``, column projections on its residual orientation and
   row projections on the swapped one).
   Options reach the layers as constructor arguments: ``overlap_input_grad`` (1D column
   layers), ``summa_overlap`` and the model's one
   :class:`gridshard.comm.grid_ops.GatheredVectors` (2D layers), which the context shares;
3. hook the shared-input parents (:mod:`gridshard.parallel.shared_input`), set a foreign
   attention module's local kv-group ratio (``plan.kv_group_attr``, Hugging Face's), and
   (sequence parallelism with a model that needs the full sequence at its embedding) the
   sequence split at ``plan.sequence_scatter``;
4. context parallelism (a mesh with ``context`` C > 1, gridshard's or Hugging Face's Llama): every attention
   module attends over the context axis (``context_mode``: ring or all-to-all,
   :mod:`gridshard.context`) and RoPE reads the global positions of the rank's two chunks
   (:func:`_split_sequence`); parameters are not split over C;
5. expert parallelism (a mesh with ``expert`` E > 1): every MoE block keeps its expert rank's n/E
   experts and exchanges token-slots over the expert axis (:meth:`gridshard.moe.layer.MoEBlock.
   split_experts`, ``expert_dispatch``); with T > 1 an MoE block gathers the whole micro-batch
   from the residual block (the scheme's ``token_gathers``, :meth:`~gridshard.moe.layer.MoEBlock.tokens_over`);
6. materialise this rank's blocks (:mod:`gridshard.parallel.materialize`) on ``device``;
7. attach a :class:`ParallelContext` with every parameter's layout.

The model is modified in place and returned.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..comm.dual_ops import scatter_to_group
from ..comm.grid_ops import GatheredVectors
from ..context import all_to_all_attention, ring_attention
from ..errors import LayoutError
from ..job_layout import ContextMode
from ..nn.shape_rules import layout_rules
from ..nn.sharding import get_spec, mesh_coords
from ..tensor.layer_build import LayerBuild
from .model_context import ParallelContext
from .materialize import init_laws, materialize
from .plan import HF_LLAMA_PLAN, LLAMA_PLAN, VIT_PLAN, Plan
from .shared_input import first_input, install_shared_input, replace_input

HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int                  # the output width: the vocabulary, or a ViT's classes
    hf: bool
    objective: str = "next_token"    # what the loss compares: "next_token" (LM) | "classify" (one label per input)


def model_dims(model: nn.Module) -> ModelDims:
    from ..models.llama import ModelConfig
    from ..models.vit import ViTConfig

    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, ModelConfig):
        return ModelDims(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size, False)
    if isinstance(cfg, ViTConfig):
        return ModelDims(cfg.hidden, cfg.heads, cfg.heads, cfg.head_dim, cfg.ffn_hidden, cfg.num_classes, False,
                         "classify")
    hf = getattr(model, "config", None)
    if hf is not None and hasattr(hf, "num_attention_heads"):
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        return ModelDims(hf.hidden_size, heads, getattr(hf, "num_key_value_heads", None) or heads, head_dim,
                         hf.intermediate_size, hf.vocab_size, True)
    raise LayoutError(f"parallelize: cannot read the dimensions of a {type(model).__name__}: expected gridshard's "
                      f"Transformer (model.cfg) or a Hugging Face model (model.config). Fix: pass one of those.")


def default_plan(model: nn.Module, dims: ModelDims) -> Plan:
    own = getattr(model, "layout_plan", None)          # a model part may state its family's plan (a pipeline rank's)
    if callable(own):
        return own()
    if not dims.hf:
        return VIT_PLAN if dims.objective == "classify" else LLAMA_PLAN     # a ViT classifies; the decoder
    model_type = getattr(model.config, "model_type", None)
    if model_type in HF_LLAMA_TYPES:
        return HF_LLAMA_PLAN
    raise LayoutError(f"parallelize: no built-in plan for Hugging Face model_type={model_type!r} (known: "
                      f"{HF_LLAMA_TYPES}). Fix: pass plan=gridshard.parallel.HF_LLAMA_PLAN.with_rules({{...}}) "
                      f"mapping its module names to kinds.")


def check_layout(dims: ModelDims, mesh, sequence_parallel: bool) -> None:
    """The layout rules of the mesh's tensor mode (:func:`gridshard.nn.shape_rules.layout_rules`,
    the ones the config validator checks too), each broken one raised as a LayoutError."""
    mode, T = mesh.tensor_mode, mesh.tensor.size
    if sequence_parallel and not mode.sequence_parallel_in_effect(True, max(T, 2)):
        raise LayoutError(f"parallelize(sequence_parallel=True) on tensor_mode={mode!r}: sequence parallelism "
                          f"splits the 1D tensor group's activations. Fix: use a 1d mesh with tensor>1, or "
                          f"sequence_parallel=False.")
    gqa, *splits = layout_rules(mode, T, dims.hidden, dims.heads, dims.ffn, dims.kv_heads)
    if not gqa.holds:
        raise LayoutError(f"parallelize: heads={dims.heads}, kv_heads={dims.kv_heads}: grouped-query attention "
                          f"needs kv_heads to divide heads. Fix: choose kv_heads among the divisors of heads.")
    for rule in splits:
        if not rule.holds:
            raise LayoutError(f"parallelize: {rule.what}={rule.value} {mode.where(T)}: {rule.why}. "
                              f"Fix: {rule.fix}.")


def _check_covered(model: nn.Module, plan: Plan, mode, sequence_parallel: bool = False) -> dict:
    """name → kind for every planned module; an unplanned module with parameters is an error
    where the mode must know how to split every weight (the scheme's ``check_unplanned``; ``none``
    splits nothing). A module ``laid_out_whole`` (an MoE block) and its children are no plan's business."""
    planned = {name: kind for name, _ in model.named_modules() if name and (kind := plan.kind_of(name)) is not None}
    whole = [name for name, m in model.named_modules() if getattr(m, "laid_out_whole", False)]
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)) or any(
                name == w or name.startswith(w + ".") for w in whole):
            continue
        if not any(name == p or name.startswith(p + ".") for p in planned):
            mode.check_unplanned(name, module)
        if planned.get(name) == "replicate":
            mode.check_replicated(name, module, sequence_parallel)
    return planned


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """Modules whose buffers are derived from a config (Hugging Face rotary embeddings) are
    rebuilt on CPU when the model was built on the meta device."""
    for name, module in list(model.named_modules()):
        if any(b is not None and b.is_meta for b in module._buffers.values()) and hasattr(module, "config"):
            with torch.device("cpu"):
                _set(model, name, type(module)(config=module.config))


def parallelize(model: nn.Module, mesh, plan: Optional[Plan] = None, *, sequence_parallel: bool = False,
                seed: int = 0, device=None, summa_overlap: bool = True,
                overlap_input_grad: bool = True, context_mode: str = "ring",
                expert_dispatch: str = "all_to_all") -> nn.Module:
    """Lay ``model`` (a plain single-device module, built on ``meta`` or with real weights) out
    on ``mesh`` (:func:`gridshard.build_mesh`) for its tensor mode; returns the same module.

    ``plan`` defaults to the model family's table; ``sequence_parallel`` (1D only);
    ``seed`` drives the counter-based initialisation of meta parameters (same seed → the
    same global model at every layout); ``device`` where the blocks live (default:
    :func:`gridshard.device.rank_device`: ``cuda:LOCAL_RANK`` under nccl, the CPU under gloo); ``summa_overlap`` (2D) double-buffered async SUMMA
    broadcasts, or blocking ones when False; ``overlap_input_grad`` (1D) each column
    layer's input-gradient collective overlapped with its weight-gradient GEMM
    (:mod:`gridshard.tensor.tp1d.input_grad_overlap`), or issued after it when False;
    ``context_mode`` (a mesh with a context axis of C > 1) ``ring`` or ``all_to_all``;
    ``expert_dispatch`` (a mesh with an expert axis of E > 1) ``all_to_all`` or ``all_gather``.
    """
    from ..device import rank_device

    if getattr(model, "parallel_context", None) is not None:
        raise LayoutError("parallelize: this model is already laid out. Fix: build a fresh plain model.")
    device = torch.device(device) if device is not None else rank_device()
    dims = model_dims(model)
    plan = plan or default_plan(model, dims)
    mode, T = mesh.tensor_mode, mesh.tensor.size
    sp = mode.sequence_parallel_in_effect(sequence_parallel, T)
    check_layout(dims, mesh, sequence_parallel)
    planned = _check_covered(model, plan, mode, sp)
    if mesh.context.size > 1:
        _split_sequence(model, dims, mesh, ContextMode.parse(context_mode), plan)

    laws = init_laws(model)
    sources = dict(model.named_parameters(remove_duplicate=False))
    vector_cache = GatheredVectors()           # the 2D layers' and the context's: one window per step

    build = LayerBuild(mesh, sp, plan.sequence_scatter == "embedding", mode.kv_replication(dims.kv_heads, T),
                       overlap_input_grad, summa_overlap, vector_cache)
    _swap_planned(model, planned, lambda name, module, kind, tied:
                  mode.build_layer(name, module, kind, build, tied))
    _hook_planned_parents(model, plan, dims, mode, T)
    if sp and plan.sequence_scatter != "embedding":
        _install_sequence_scatter(model, plan.sequence_scatter, mesh)

    if mesh.expert.size > 1:
        _split_experts(model, mesh.expert, expert_dispatch)
    gathers = mode.token_gathers(mesh, sp)
    for module in model.modules():
        if gathers and callable(getattr(module, "tokens_over", None)):     # an MoE block runs on whole tokens
            module.tokens_over(gathers)
    _rebuild_meta_buffers(model)
    materialize(model, sources, laws, mesh_coords(mesh), seed, device)
    from ..nn.sharding import ShardSpec

    layouts = {name: (get_spec(p) or ShardSpec(tuple(p.shape)))
               for name, p in model.named_parameters(remove_duplicate=False)}
    model.parallel_context = ParallelContext(mesh, mode, sp, dims.vocab, dims.hf, layouts, vector_cache,
                                             objective=dims.objective)
    return model


def _split_sequence(model: nn.Module, dims: ModelDims, mesh, context_mode: ContextMode, plan: Plan) -> None:
    """Context parallelism: the model sees context rank i's chunks i and 2C − 1 − i of every
    sequence, so its rotary embedding reads their global positions and each attention module
    attends over the context axis (ring or all-to-all). gridshard's Llama: ``split_sequence`` (RoPE
    rows), ``Attention.attend_over_context`` and an MoE block's ``sequences_over``. A Hugging Face Llama: the plan's attention modules
    attend through :data:`gridshard.models.hf.CONTEXT_ATTENTION` (no mask built), and the positions
    reach its rotary embedding as ``position_ids`` (:meth:`ParallelContext.logits`; a pipeline
    rank's pieces: ``split_sequence``). LayoutError, before any collective, for another model or
    all-to-all heads that C does not divide."""
    from ..models.llama import Attention

    axis, mode, T = mesh.context, mesh.tensor_mode, mesh.tensor.size
    splits = callable(getattr(model, "split_sequence", None))
    if dims.objective != "next_token" or not (dims.hf or splits):
        raise LayoutError(f"parallelize: context={axis.size} splits sequences for a Llama (gridshard's Transformer "
                          f"or Hugging Face's), not a {type(model).__name__}. Fix: use context=1 for this model.")
    context_mode.check_heads(dims.heads // mode.head_split(T), mode.local_kv_heads(dims.kv_heads, T), axis.size)
    attend = functools.partial(ring_attention if context_mode is ContextMode.RING else all_to_all_attention,
                               axis=axis)
    if splits:
        model.split_sequence(axis.size, axis.rank)
    for module in model.modules():
        if callable(getattr(module, "sequences_over", None)):       # an MoE block: per-sequence sums over C
            module.sequences_over(axis)
    if dims.hf:
        from ..models.hf import attend_over_context

        modules = [m for n, m in model.named_modules() if plan.is_attention(n)]
        if not modules:
            raise LayoutError(f"parallelize: context={axis.size} needs the attention modules, and the plan's attention "
                              f"patterns {plan.attention} match none of this {type(model).__name__}. Fix: set the "
                              f"plan's attention to the self-attention modules' names.")
        attend_over_context(model, modules, attend)
        return
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend_over_context(attend)


def _split_experts(model: nn.Module, axis, kind: str) -> None:
    blocks = [m for m in model.modules() if callable(getattr(m, "split_experts", None))]
    if not blocks and not getattr(getattr(model, "cfg", None), "experts", 0):    # (a pipeline stage may hold none)
        raise LayoutError(f"parallelize: expert={axis.size} splits the experts of MoE layers, and this "
                          f"{type(model).__name__} has none. Fix: use parallel.expert=1, or give the model experts.")
    for block in blocks:
        block.split_experts(axis, kind)


def _swap_planned(model: nn.Module, planned: dict, build) -> None:
    """Replace every planned module (but ``replicate``) by ``build(name, module, kind, tied)``.
    Embeddings are built first, so a vocabulary head tied to one is built on it (``tied``: 1D
    shares its parameter, 2D reads its table in a TiedVocabHead2D)."""
    modules = dict(model.named_modules())
    embeddings = {}
    for name in sorted(planned, key=lambda n: planned[n] == "vocab_head"):     # heads after embeddings
        kind, module = planned[name], modules[name]
        if kind == "replicate":
            continue
        tied = None
        if kind == "vocab_head":
            tied = next((e for src, e in embeddings.values() if src is module.weight), None)
        new = build(name, module, kind, tied)
        if kind == "vocab_embedding":
            embeddings[name] = (module.weight, new)
        _set(model, name, new)


def _hook_planned_parents(model: nn.Module, plan: Plan, dims: ModelDims, mode, T: int) -> None:
    """After the swap, what the plan says about parent modules it names by pattern:

    * ``plan.shared_inputs``: each matching parent computes its column children from one prepared
      input (:func:`gridshard.parallel.shared_input.install_shared_input`, a forward pre-hook);
    * ``plan.attention`` with ``plan.kv_group_attr``: a foreign attention module (Hugging Face's
      ``num_key_value_groups``) reads its query-per-kv-head ratio from that attribute, which the
      split changes to the *local* ratio (local heads / local kv heads). gridshard's own attention
      needs nothing: it reads the ratio from the tensors it gets.

    A matching module without the children or the attribute the plan names is a plan that does not
    fit the model: a LayoutError, not a silent skip. A module that says it is ``laid_out_whole``
    (an MoE block, :class:`gridshard.moe.layer.MoEBlock`, where a dense model has its MLP) is not
    one the plan's patterns describe."""
    local_groups = (dims.heads // mode.head_split(T)) // mode.local_kv_heads(dims.kv_heads, T)
    for name, module in list(model.named_modules()):
        children = plan.shared_children(name)
        if children and not getattr(module, "laid_out_whole", False):
            missing = [c for c in children if not isinstance(getattr(module, c, None), nn.Module)]
            if missing:
                raise LayoutError(f"parallelize: the plan's shared_inputs name children {list(children)} of "
                                  f"{name!r} ({type(module).__name__}), which has no {missing}. Fix: correct the "
                                  f"plan's shared_inputs pattern or children for this model.")
            install_shared_input(module, children, mode)
        if plan.kv_group_attr and plan.is_attention(name):
            if getattr(module, plan.kv_group_attr, None) is None:
                raise LayoutError(f"parallelize: attention module {name!r} ({type(module).__name__}) has no "
                                  f"{plan.kv_group_attr!r}, which the plan's kv_group_attr names. Fix: set the "
                                  f"plan's kv_group_attr to the attribute this attention reads, or to None.")
            setattr(module, plan.kv_group_attr, local_groups)


def _install_sequence_scatter(model: nn.Module, name: str, mesh) -> None:
    try:
        target = model.get_submodule(name)
    except AttributeError:
        raise LayoutError(f"parallelize: plan.sequence_scatter={name!r} names no module of this model. Fix: "
                          f"name the first decoder layer, or 'embedding'.") from None

    def split(module, args, kwargs):                   # its first input (positional, or hidden_states=…) cut
        return replace_input(args, kwargs, scatter_to_group(first_input(args, kwargs), mesh.tensor, 1))

    target.register_forward_pre_hook(split, with_kwargs=True)
