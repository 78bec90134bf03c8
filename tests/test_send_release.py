"""Sends given back at the first point their transfer is proven done (:mod:`gridshard.pipeline.send_release`).

:func:`release_points` replays torch's lowered action lists with vector clocks. Checked here against
an independent reading of the same lists: the happens-before graph (each rank's actions in order; a
send before the compute that waits on its receive), searched breadth-first. A send is proven done at
this rank's compute k when the compute that waits on its receive (on the receiving rank) happens
before k; its release point must be the first such compute of this rank, and a send with none must
have no point. The lists are the ones torch builds for the trainer's schedules (interleaved 1F1B and
zero bubble, P = 2 and 4, V = 2, A = 8 and 16). That the release frees memory and changes no result:
``tests/test_pipeline.py`` (the receive-buffer counts, and every schedule equal to one device)."""
from collections import deque

import pytest

from gridshard.engine import Trainer
from gridshard.pipeline.send_release import COMPUTE, release_points
from gridshard.testing import run_on_ranks
from gridshard.torch_private import lowered_pipeline_order

from .test_pipeline import _cfg


def _lowered(cfg):
    return lowered_pipeline_order(Trainer(cfg, progress=False).pipeline.schedule)


def _happens_before(orders, stage_rank):
    """Successors of each (rank, position): the next position, and for a send the compute that
    waits on its receive; plus each send's consumer (rank, position)."""
    S = len(stage_rank)
    at = {(r, COMPUTE[k], s, m): i for r, acts in orders.items() for i, (k, s, m) in enumerate(acts) if k in COMPUTE}
    succ, consumer = {}, {}
    for r, acts in orders.items():
        for i, (kind, stage, mb) in enumerate(acts):
            succ[(r, i)] = [(r, i + 1)] if i + 1 < len(acts) else []
            if kind in ("SEND_F", "SEND_B"):
                to = stage + 1 if kind == "SEND_F" else stage - 1
                assert 0 <= to < S
                b = stage_rank[to]
                c = at[(b, "F" if kind == "SEND_F" else "B", to, mb)]
                consumer[(kind, stage, mb)] = (b, c)
                # the receive is waited right before its consumer: the send happens before it
                succ[(r, i)].append((b, c))
    return succ, consumer


def _reachable(succ, start):
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in succ[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("schedule,P,A", [("interleaved_1f1b", 2, 8), ("zero_bubble", 2, 16),
                                          pytest.param("interleaved_1f1b", 4, 8, marks=pytest.mark.wide),
                                          pytest.param("zero_bubble", 4, 8, marks=pytest.mark.wide)])
def test_each_send_is_released_at_the_first_compute_that_proves_it(schedule, P, A):
    """Also: only the backward sends of the step's last P·(P − 1) are left to the step's end,
    whatever A (after its last backward a rank hears nothing more from the ranks before it)."""
    cfg = _cfg(1, P, 1, "none", False, schedule, 2, steps=1, global_batch=2 * A)
    cfg["model"]["layers"] = 2 * P
    orders, stage_rank = run_on_ranks(P, _lowered, cfg)[0]
    succ, consumer = _happens_before(orders, stage_rank)
    released, unproven = 0, set()
    for me, actions in orders.items():
        points = release_points(orders, stage_rank, me)
        at_point = {send: key for key, sends in points.items() for send in sends}
        for i, (kind, stage, mb) in enumerate(actions):
            if kind not in ("SEND_F", "SEND_B"):
                continue
            after = _reachable(succ, consumer[(kind, stage, mb)])
            proofs = [(COMPUTE[k], s, m) for j, (k, s, m) in enumerate(actions)
                      if j > i and k in COMPUTE and (me, j) in after]
            assert at_point.get((kind, stage, mb)) == (proofs[0] if proofs else None), (me, kind, stage, mb)
            released += bool(proofs)
            if not proofs:
                unproven.add(kind)
    sends = sum(k in ("SEND_F", "SEND_B") for acts in orders.values() for k, _, _ in acts)
    assert sends - released <= P * (P - 1) and unproven <= {"SEND_B"}, (sends, released, unproven)
