"""Pipeline parallelism in numbers: bytes between stages, the bubble, activations in flight.

**Stage-to-stage bytes.** One micro-batch of m sequences of s tokens crosses each stage
boundary twice: the activation forward and its gradient backward, each one rank's block of
the [m, s, h] hidden state (:meth:`gridshard.job_layout.TensorMode.boundary_block`) in
elements of e bytes (:data:`DTYPE_BYTES`: 4 in fp32, 2 in bf16/fp16)::

    none / 1D        m·s·h·e          (the tensor ranks of a stage each send the same block)
    1D + SP          m·(s/T)·h·e      (each tensor rank its sequence block)
    2D (q×q grid)    (m/q)·s·(h/q)·e  (each grid rank its batch-row × hidden-column block)
    2.5D (d × q×q)   (m/(d·q))·s·(h/q)·e  (depth layer k's 2D block of its m/d rows; ``depth`` d)

per rank, per micro-batch, per boundary and direction (:func:`boundary_bytes`; its ``dtype``
is the element type sent). What is sent is the residual stream: gridshard's fp32 runs send
fp32 (asserted by the ledger tests); under bf16/fp16 autocast gridshard's model keeps the
residual stream in the compute dtype (:mod:`gridshard.models.llama`, "Precision") and sends
2-byte elements, as Megatron-style mixed precision does and as the planner prices a bf16 run
(docs/planner.md); a Hugging Face model keeps an fp32 residual stream and sends 4 bytes. 1D without
sequence parallelism sends the whole block from every tensor rank (Megatron's scatter/gather
of it over the tensor group is not implemented). A rank at
stage i of S (one stage per rank) sends forward when i < S−1 and backward when i > 0, so per
optimizer step with A micro-batches it sends A·boundary_bytes·([i < S−1] + [i > 0])
(:func:`step_send_bytes`); with V virtual stages per rank, the same per stage it holds.

**Bubble.** With P stages of equal cost and A micro-batches, GPipe and 1F1B leave each stage
idle for (P−1) of the A+P−1 slots of a step: bubble = (P−1)/(A+P−1); interleaving V stages
per rank shrinks the idle slots V-fold: (P−1)/(V·A+P−1) (Narayanan et al. 2021)
(:func:`bubble_fraction`).

**Activations in flight.** GPipe runs all A forwards before any backward: stage i holds A
micro-batches' activations at its peak. 1F1B starts backward as soon as the last stage has
a loss: stage i holds at most min(A, P−i) (:func:`peak_in_flight`).

**Stage buffers** (:func:`stage_buffer_bytes`). ``torch.distributed.pipelining.PipelineStage``
allocates, when the schedule first runs, one receive buffer per micro-batch for the stage's
input (every stage but the first) and one for the gradient of its output (every stage but the
last), B = :func:`boundary_bytes` each, and keeps them; it also keeps each micro-batch's stage
output from its forward to its backward (``fwd_cache``; Megatron frees that storage once sent).
The input buffer of a micro-batch in flight is the tensor the stage's first layer keeps (counted
with the activations), so a stage holds beyond its activations, with A micro-batches of which
``in_flight`` are in flight::

    [not first]·(A − in_flight)·B + [not last]·(A + in_flight)·B
"""
from __future__ import annotations

from ..job_layout import TensorMode

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}     # element size of a ``train.precision`` value


def boundary_bytes(mode, sequence_parallel: bool, T: int, micro_batch: int, seq_len: int, hidden: int,
                   dtype: str = "fp32", depth: int = 1) -> int:
    """Bytes one rank sends across one stage boundary for one micro-batch, one direction: its
    block of the hidden state (:meth:`gridshard.job_layout.TensorMode.boundary_block`) in
    elements of ``dtype`` (``fp32`` | ``bf16`` | ``fp16``, :data:`DTYPE_BYTES`); ``depth``: 2.5D's d."""
    m, s, h = TensorMode.parse(mode).boundary_block(T, sequence_parallel, micro_batch, seq_len, hidden, depth)
    return m * s * h * DTYPE_BYTES[dtype]


def step_send_bytes(stage_indices, num_stages: int, n_microbatches: int, per_boundary: int) -> int:
    """Bytes a rank sends in one optimizer step (forward activations + backward gradients)."""
    sends = sum((s < num_stages - 1) + (s > 0) for s in stage_indices)
    return n_microbatches * per_boundary * sends


def bubble_fraction(P: int, n_microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Idle fraction of a step per stage at equal stage costs (module docstring)."""
    A = n_microbatches
    if schedule == "interleaved_1f1b":
        return (P - 1) / (virtual_stages * A + P - 1)
    return (P - 1) / (A + P - 1)


def peak_in_flight(stage: int, P: int, n_microbatches: int, schedule: str = "1f1b") -> int:
    """Most micro-batches whose activations stage ``stage`` (one stage per rank) holds."""
    if schedule == "gpipe":
        return n_microbatches
    return min(n_microbatches, P - stage)


def stage_buffer_bytes(first: bool, last: bool, n_microbatches: int, in_flight: int, per_boundary: int) -> int:
    """Bytes a pipeline stage holds in receive buffers and kept stage outputs beyond its
    activations (module docstring, "Stage buffers")."""
    A = n_microbatches
    return (0 if first else (A - in_flight) * per_boundary) + (0 if last else (A + in_flight) * per_boundary)
