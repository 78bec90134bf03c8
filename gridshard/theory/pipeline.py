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

Zero bubble (``zero_bubble``: PyTorch's ``ScheduleInterleavedZeroBubble``, the ZB1P schedule of Qi
et al. 2024, arXiv 2401.10241) splits each backward into an input pass I and a weight pass W, and
fills the idle slots with deferred W passes. Counted in chunks (1/V of a rank's layers), each F,
I and W one unit (a backward of 2 units split evenly, the paper's assumption), a rank is busy 3·V·A
units and the slowest finishes at T = max(2VP + 2A − 1, 2VA + V·max(A, P) + P − 1); for A ≥ P
(what the config requires: a multiple of P) T = 3VA + P − 1 and every rank idles P − 1 units::

    bubble = (P−1)/(3·V·A + P − 1)        (a third of interleaved 1F1B's idle time)

Each chunk's activations live from its F to its W (the weight pass reads the layers' inputs); at
most min((V − 1)·A_r + P, V·A) chunks on every rank, A_r = A / max(1, ⌊A/P⌋) the micro-batches
per round: P micro-batches of the rank's layers when P divides A (:func:`zero_bubble_in_flight`,
an upper estimate: the I pass already frees what only the input gradient reads). Both replayed
from PyTorch's own action lists for P ∈ {2, 3, 4, 8}, V ∈ {2, 4} and every A ≤ 8P the schedule
accepts, with dependencies enforced (``tests/test_pipeline.py`` reads a real run's list).

**Activations in flight.** GPipe runs all A forwards before any backward: stage i holds A
micro-batches' activations at its peak. 1F1B starts backward as soon as the last stage has
a loss: stage i holds at most min(A, P−i) (:func:`peak_in_flight`).

**Stage buffers** (:func:`stage_buffer_bytes`). ``torch.distributed.pipelining.PipelineStage``
allocates, when the schedule first runs, one receive buffer per micro-batch for the stage's
input and one for the gradient of its output, and keeps all 2·A (pytorch/pytorch#136380).
gridshard's stages receive just in time (:func:`gridshard.torch_private.receive_just_in_time`):
an input buffer lives from its receive to its micro-batch's backward, an output-gradient buffer
from its receive to that backward, as Megatron allocates them. The input buffer of a micro-batch
in flight is the tensor the stage's first layer keeps (counted with the activations); the stage
also keeps each micro-batch's output from its forward to its backward (``fwd_cache``; Megatron
frees that storage once sent). So a stage with ``in_flight`` micro-batches in flight holds, beyond
its activations, B = :func:`boundary_bytes` each::

    [not last]·(in_flight + 1)·B          (kept outputs, and the one output gradient received)

whatever the number of micro-batches A (``tests/test_pipeline.py`` counts the buffers a P = 4
run of A = 16 holds). A rank of V stages (interleaved, zero bubble) holds one kept output per
chunk in flight: V·held + 1 blocks, held its micro-batches in flight, and the sends of
:mod:`gridshard.pipeline.send_release`: torch's runtime for these schedules keeps every send until
the step's end (up to 2·A·V blocks by then: 48 on rank 0 at P = 2, V = 2, A = 16), and gridshard gives each back
once the receiving rank is known to have it. What is still held then (a send not yet proven done,
an output gradient received ahead of its backward) is :func:`sends_held`, an upper bound read off
the runs (A does not change it), not derived.
"""
from __future__ import annotations

import math

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
    A, V = n_microbatches, virtual_stages
    if schedule == "interleaved_1f1b":
        return (P - 1) / (V * A + P - 1)
    if schedule == "zero_bubble":
        makespan = max(2 * V * P + 2 * A - 1, 2 * V * A + V * max(A, P) + P - 1)
        return 1 - 3 * V * A / makespan
    return (P - 1) / (A + P - 1)


def zero_bubble_in_flight(P: int, V: int, n_microbatches: int) -> int:
    """Micro-batches of a rank's whole layer set whose activations zero bubble holds at its peak
    (module docstring): ⌈min((V − 1)·A_r + P, V·A) / V⌉, the same on every rank."""
    A = n_microbatches
    per_round = A // max(1, A // P)
    return -(-min((V - 1) * per_round + P, V * A) // V)


def interleaved_in_flight(rank: int, P: int, V: int, A: int) -> int:
    """Micro-batches (of the rank's whole layer set) rank ``rank`` holds under interleaved 1F1B: it warms
    up with 2·(P − r − 1) + (V − 1)·P + 1 forward chunks of 1/V of its layers before its first backward
    (Narayanan et al. 2021's interleaved schedule): ⌈(2·(P − r − 1) + (V − 1)·P + 1) / V⌉, at most A."""
    return min(A, math.ceil((2 * (P - rank - 1) + (V - 1) * P + 1) / V))


def peak_in_flight(stage: int, P: int, n_microbatches: int, schedule: str = "1f1b") -> int:
    """Most micro-batches whose activations stage ``stage`` (one stage per rank) holds."""
    if schedule == "gpipe":
        return n_microbatches
    return min(n_microbatches, P - stage)


def sends_held(schedule: str, rank: int, P: int) -> int:
    """Boundary blocks a rank of several stages holds beyond its V·held kept outputs and one output
    gradient (module docstring, "Stage buffers"): its sends not yet proven done and output gradients
    received early. The most measured at P ∈ {2, 3, 4, 6, 8}, V ∈ {2, 4}, A ≤ 16, rounded up to a
    rule (``tests/test_pipeline.py``): interleaved 1F1B 1 on rank 0, 2 on a middle rank, ⌈P/2⌉ + 2 on
    the last; zero bubble (its outputs are kept to the weight pass) P on rank 0, r + 1 on rank r,
    ⌈3P/2⌉ on the last."""
    last = rank == P - 1
    if schedule == "interleaved_1f1b":
        return -(-P // 2) + 2 if last else (1 if rank == 0 else 2)
    if schedule == "zero_bubble":
        return -(-3 * P // 2) if last else (P if rank == 0 else rank + 1)
    return 0


def stage_buffer_bytes(last: bool, in_flight: int, per_boundary: int) -> int:
    """Bytes a pipeline stage holds in receive buffers and kept stage outputs beyond its
    activations (module docstring, "Stage buffers"): [not last]·(in_flight + 1)·B."""
    return 0 if last else (in_flight + 1) * per_boundary
