"""Predicted peak memory of a layout: the worst rank of :func:`gridshard.theory.memory.predict_rank_memory`.

No formula lives here; this module only decides *which ranks* to ask about and with what
arguments, the way the trainer does (:meth:`gridshard.engine.trainer.Trainer._predict_memory`):

* data rank 0 (it owns the most rows of every ZeRO shard: ``ceil(n0/D)``);
* the pipeline ranks that can hold the most: the first (embedding, the most micro-batches
  in flight), the last (head, loss and logits) and the first rank holding the most decoder
  layers; rank r holds stages r, r+P, … of the
  P·V stages, whose layers come from :class:`gridshard.job_layout.StageSplit`
  (the split the pipeline builder uses); the first stage's rank holds the embedding, the
  last's the final norm, head and loss.

``baseline_bytes`` is the hardware's ``reserved_bytes`` (GPU: CUDA context, NCCL buffers,
allocator; CPU: the Python + torch + gloo resident set measured before the model is built).

Safety margin: ``margin_fraction`` (10 % by default, from the hardware file) of what the step
allocates and frees again (activations, buffers, transients; not the model state, laid out once),
as :class:`~gridshard.theory.memory.RankMemory` states it; a layout fits when
``total_with_margin`` ≤ the device's memory (for a GPU, what CUDA reports as its total).

Interleaved 1F1B (an adapter: the memory model counts one stage per rank): rank r warms up
with 2·(P − r − 1) + (V − 1)·P + 1 forward chunks of 1/V of its layers before its first
backward (Narayanan et al. 2021's interleaved schedule), so it holds about
⌈(2·(P − r − 1) + (V − 1)·P + 1) / V⌉ micro-batches of its layers (at most A) instead of
min(A, P − r); :func:`gridshard.theory.pipeline.interleaved_in_flight` gives the count and
:func:`gridshard.theory.memory.predict.with_virtual_stages` (which the trainer's prediction applies
too) adds the difference × the rank's activation bytes per micro-batch; its stages keep one output per
chunk in flight and one output gradient received, (V·held + 1)·B in comm buffers
(:func:`gridshard.theory.pipeline.stage_buffer_bytes`). Zero bubble
(``zero_bubble``, V stages per rank as interleaving) the same, with
:func:`gridshard.theory.pipeline.zero_bubble_in_flight` micro-batches held (P on every rank when P
divides A: each chunk's activations kept until its deferred weight pass; fewer than 1F1B's P − r on
no rank, more on the later ranks).

Context parallelism (``layout.context`` C > 1): ZeRO shards over data × context, so the rank is
data rank 0 of D·C; the activations, logits and stage buffers hold the rank's S/C tokens of each
sequence, with the attention's C > 1 terms (:func:`gridshard.theory.memory.predict_rank_memory`).

Precision: activations are priced in the run's compute dtype (``precision``: e = 2 bytes under
bf16/fp16, with the fp32 parts the memory model states: norm statistics, log-sum-exp, the loss's
softmax, and autocast's bf16 copies of the fp32 weights), as the trainer's prediction does.
"""
from __future__ import annotations

from ..job_layout import StageSplit, micro_batches_per_step
from ..theory.memory import predict_rank_memory
from ..theory.memory.predict import with_virtual_stages
from ..theory.pipeline import boundary_bytes, interleaved_in_flight
from .layouts import Layout
from .memo import rank_blocks


def stage_layers_of_rank(layers: int, P: int, V: int, explicit=None) -> list:
    """Decoder layer ids of each pipeline rank (stages r, r+P, … of the P·V stages); ``explicit``:
    the layout's ``stage_layers`` (None: the default split)."""
    split = StageSplit.of(layers, P, V, explicit)
    return [split.rank_layer_ids(r) for r in range(P)]


def ranks_to_check(layer_ids: list) -> list:
    """Pipeline ranks whose memory can be the largest: first, last, and those with the most layers."""
    P = len(layer_ids)
    most = max(len(x) for x in layer_ids)
    heavy = next(r for r in range(P) if len(layer_ids[r]) == most)
    return sorted({0, P - 1, heavy})


def layout_memory(model_cfg, layout: Layout, seq_len: int, global_batch: int, baseline_bytes: int = 0,
                  margin_fraction: float = 0.10, precision: str = "fp32", documents: bool = False):
    """(worst RankMemory, pipeline rank it belongs to) of ``layout`` (module docstring): the largest
    of :func:`rank_memories` (the lowest rank on a tie). Not memoised: a search prices each
    layout's memory once (measured: no repeated call in ``plan`` of configs/llama_7b.yaml on 64 GPUs)."""
    mems = rank_memories(model_cfg, layout, seq_len, global_batch, baseline_bytes, margin_fraction, precision,
                         documents)
    r = max(mems, key=lambda k: (mems[k].total_with_margin, -k))
    return mems[r], r


def rank_memories(model_cfg, layout: Layout, seq_len: int, global_batch: int, baseline_bytes: int = 0,
                  margin_fraction: float = 0.10, precision: str = "fp32", documents: bool = False) -> dict:
    """Pipeline rank → its RankMemory, for the ranks that can be the largest (:func:`ranks_to_check`;
    rank 0 without a pipeline), interleaving adapted as the module docstring says. A 2.5D layout is
    priced as the 2D layout each of its ranks runs (:meth:`~gridshard.planner.layouts.Layout.layer_layout`)."""
    layout = layout.layer_layout()
    P, V = layout.pipeline, layout.virtual_stages
    A = micro_batches_per_step(global_batch, layout.micro_batch, layout.data)
    per_rank = stage_layers_of_rank(model_cfg.layers, P, V, layout.stage_layers) if P > 1 else [None]
    out = {}
    for r in ranks_to_check(per_rank) if P > 1 else [0]:
        mem = predict_rank_memory(
            model_cfg, mode=layout.tensor_mode, T=layout.tensor, sequence_parallel=layout.sequence_parallel,
            data=layout.data * layout.context, data_rank=0, zero=layout.zero, recompute=layout.recompute,
            micro_batch=layout.micro_batch, seq_len=seq_len, n_microbatches=A, pipeline=P, pipeline_rank=r,
            schedule=layout.pipeline_schedule, layer_ids=per_rank[r], baseline_bytes=int(baseline_bytes),
            margin_fraction=float(margin_fraction), precision=precision,
            context=layout.context, context_mode=layout.context_mode,
            overlap_grad_reduce=layout.overlap_grad_reduce, expert=layout.expert, documents=documents,
            blocks=rank_blocks(model_cfg, layout.tensor_mode, layout.tensor, per_rank[r], r == 0, r == P - 1,
                               layout.expert))
        out[r] = with_virtual_stages(mem, schedule=layout.pipeline_schedule, rank=r, P=P, V=V, A=A,
                                     per_boundary=boundary_bytes(layout.tensor_mode, layout.sequence_parallel,
                                                                 layout.tensor, layout.micro_batch,
                                                                 seq_len // layout.context, model_cfg.hidden,
                                                                 precision))
    return out


__all__ = ["layout_memory", "rank_memories", "stage_layers_of_rank", "ranks_to_check", "interleaved_in_flight"]
