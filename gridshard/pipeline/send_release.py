"""Sent activations and gradients given back once their transfer is proven done, not at the step's end.

torch's runtime for the schedules of several stages per rank (``interleaved_1f1b``, ``zero_bubble``:
``_PipelineScheduleRuntime``) keeps the ``Work`` of every send until the step's last action, where it
waits on them all, and a Work holds the tensor it sent. So every output a rank sent forward and every
input gradient it sent back stayed in memory to the end of the step: at P = 2, V = 2, A = 8, all 24
sends of rank 0 were still held at its last backward (the 1F1B schedule, which waits each send at its
next exchange, held one). That is up to 2·A·V boundary blocks (:func:`gridshard.theory.pipeline.boundary_bytes`)
per rank, growing with the micro-batches, where Megatron frees each sent tensor once its send is
waited. The Works are local to the runtime's step, so a stage cannot wait on or poll them.

**The proof.** A send X from rank a to rank b is done once a knows that b has waited on X's receive:
the data then arrived, so nothing reads a's buffer any more. The runtime runs each rank's action list in
order and waits on a receive right before the compute that consumes it (``F`` for ``RECV_F``, ``B`` or
``I`` for ``RECV_B``), and a rank learns of another only through what it receives: after waiting on a
message that b sent at position m of its list, a knows that b passed every position before m, and all
that b knew then (vector clocks, Lamport 1978). :func:`release_points` replays the lowered per-rank
lists once (:func:`gridshard.torch_private.lowered_pipeline_order`: torch's compute actions with the
sends and receives it inserted) and gives each of this rank's sends the first of this rank's compute
actions at whose start the proof holds. A forward send is typically proven at a backward of this
stage (the next stage's gradient came from a forward that had received it); a backward send at a
later forward (the previous stage sent it after its backward had received the gradient).

**The release** (:class:`SendRelease`). At that compute's start (its receive already waited), the
sent tensor's storage is resized to 0 bytes when the send is its only holder: nothing but the Work and
this record refers to the tensor, and no other tensor shares its storage; a stage output, moreover,
only once its micro-batch's backward on this stage has run (the stage keeps the output to start that
backward from, and a torch that sends the output itself rather than a detached alias would leave the
holder count blind to it). A proven send still held otherwise is tried again at every later
compute's start and end. The step's final wait then finds empty tensors. On a GPU the order holds
on the devices too: the receiving rank's computes wait on its receive on their stream, its answering
send follows them, and this rank's computes wait on that message before any kernel can reuse the
freed block on this rank's compute stream.
Nothing else changes: the same sends, receives and waits in the same order (the training runs equal
one device as before, ``tests/test_pipeline.py``), on any backend.

Why by hand: torch's own fix (polling ``Work.is_completed()``, pytorch/pytorch#194120–194122) is not
in a release, and the runtime offers no hook on its sends.
"""
from __future__ import annotations

from ..torch_private import can_count_holders, lowered_pipeline_order, only_holders

COMPUTE = {"F": "F", "B": "B", "I": "B", "W": "W"}      # action kind → the stage call that runs it


def release_points(orders: dict, stage_rank: dict, me: int):
    """``{(call, stage, micro-batch): [send, ...]}``: the sends of rank ``me`` proven done at the start
    of each of its compute actions (call ``F``, ``B`` for ``B`` and ``I``, ``W``), a send named
    ``(SEND_F | SEND_B, stage, micro-batch)``; ``orders``, ``stage_rank``: as
    :func:`gridshard.torch_private.lowered_pipeline_order` gives them. None when the lists cannot be
    replayed to their ends (a receive with no send before it)."""
    S = len(stage_rank)
    consumer_at = {}                       # (rank, call, stage, mb) → position of that compute
    for rank, actions in orders.items():
        for k, (kind, stage, mb) in enumerate(actions):
            if kind in COMPUTE:
                consumer_at[(rank, COMPUTE[kind], stage, mb)] = k

    def awaited(rank, kind, stage, mb):
        """The send whose receive this compute waits on, or None."""
        if kind == "F" and stage > 0 and stage_rank[stage - 1] != rank:
            return ("SEND_F", stage - 1, mb)
        if kind in ("B", "I") and stage < S - 1 and stage_rank[stage + 1] != rank:
            return ("SEND_B", stage + 1, mb)
        return None

    def consumer(kind, stage, mb):
        """(rank, position) of the compute that waits on this send's receive."""
        to = stage + 1 if kind == "SEND_F" else stage - 1
        rank = stage_rank[to]
        return rank, consumer_at.get((rank, "F" if kind == "SEND_F" else "B", to, mb))

    ranks = list(orders)
    clock = {r: {b: -1 for b in ranks} for r in ranks}        # what r knows: the last position of b passed
    at = {r: 0 for r in ranks}
    messages, pending, points = {}, [], {}
    while any(at[r] < len(orders[r]) for r in ranks):
        moved = False
        for r in ranks:
            while at[r] < len(orders[r]):
                kind, stage, mb = orders[r][at[r]]
                wait = awaited(r, kind, stage, mb) if kind in COMPUTE else None
                if wait is not None:
                    if wait not in messages:
                        break
                    for b, k in messages[wait].items():
                        clock[r][b] = max(clock[r][b], k)
                clock[r][r] = at[r]
                if kind in ("SEND_F", "SEND_B"):
                    messages[(kind, stage, mb)] = dict(clock[r])
                    if r == me:
                        pending.append(((kind, stage, mb), *consumer(kind, stage, mb)))
                if r == me and kind in COMPUTE:
                    proven = [p for p in pending if p[2] is not None and clock[r][p[1]] >= p[2]]
                    if proven:
                        points.setdefault((COMPUTE[kind], stage, mb), []).extend(p[0] for p in proven)
                        pending = [p for p in pending if p not in proven]
                at[r] += 1
                moved = True
        if not moved:
            return None
    return points


class SendRelease:
    """Gives back this rank's sent tensors at their proven points (module docstring); inactive for a
    schedule without a lowered list (``gpipe``, ``1f1b``: they wait each send themselves) or on a torch
    where the proof or the holder count cannot be had."""

    def __init__(self, schedule, stages, rank: int):
        lowered = lowered_pipeline_order(schedule)
        self.points = None if lowered is None or not can_count_holders() else release_points(*lowered, rank)
        self.sent, self.proven = {}, []
        self.backward_done = set()              # (stage, micro-batch) whose backward ran this step
        self.active = False                    # only inside a training step (``step``), not in evaluation
        if self.points is None:
            return
        for stage in stages:
            self._attach(stage)

    def step(self, run):
        """Run the schedule's training step ``run()`` with releases on; drops the records after it
        (the runtime's final wait has let go of every Work)."""
        self.active = self.points is not None
        try:
            return run()
        finally:
            self.active = False
            self.sent.clear()
            self.proven.clear()
            self.backward_done.clear()

    def _attach(self, stage) -> None:
        index = stage.stage_index
        fsend, bsend = stage.get_fwd_send_ops, stage.get_bwd_send_ops

        def recorded(kind, make):
            def get_ops(chunk):
                ops = make(chunk)
                if self.active:               # a stage output waits for its micro-batch's backward here
                    after = (index, chunk) if kind == "SEND_F" else None
                    self.sent[(kind, index, chunk)] = [(op.tensor, after) for op in ops]
                return ops
            return get_ops

        def released_around(call, method):
            def run(chunk, *args, **kwargs):
                if self.active:
                    for send in self.points.get((call, index, chunk), ()):
                        self.proven.extend(self.sent.pop(send, ()))
                    self._give_back()
                out = method(chunk, *args, **kwargs)
                if self.active:
                    if call == "B":
                        self.backward_done.add((index, chunk))
                    self._give_back()
                return out
            return run

        stage.get_fwd_send_ops = recorded("SEND_F", fsend)
        stage.get_bwd_send_ops = recorded("SEND_B", bsend)
        stage.forward_one_chunk = released_around("F", stage.forward_one_chunk)
        stage.backward_one_chunk = released_around("B", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = released_around("W", stage.backward_weight_one_chunk)

    def _give_back(self) -> None:
        """Free each proven send whose only holders are its Work and this record; keep the others."""
        kept = []
        for tensor, after in self.proven:
            if (after is None or after in self.backward_done) and only_holders(tensor, 2):   # this record, the Work
                tensor.untyped_storage().resize_(0)
            elif tensor.untyped_storage().nbytes():
                kept.append((tensor, after))
        self.proven = kept
