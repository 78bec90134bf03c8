"""A collective that timed out, explained: which call, on which group, where in the step, and which
members did not arrive.

When a collective waits longer than ``train.collective_timeout_s`` the backend raises (gloo:
"Timed out waiting N ms for recv operation to complete"; or "Connection closed by peer" on a rank
whose peer's own wait ended first), which names neither the collective nor who is missing. The ledger numbers every call on each group (:mod:`gridshard.comm.ledger`,
"Positions"): the members issue the same calls on a group in the same order, so every member's
k-th call on a group is the same collective. On a timeout, each rank that caught it

1. publishes its position in the job's key-value store (the one the process group was created
   with: still reachable when the collectives are not): its latest call (op, axis, members,
   number), its count of calls on every group, and its step, phase and micro-batch
   (:class:`gridshard.engine.profiling.Ranges`);
2. waits up to ``ANSWER_S`` seconds (at most the timeout) for the other members of its call's
   group to publish theirs: a member stuck somewhere else times out there too, at about the
   same time;
3. raises :class:`CollectiveTimeout`, whose one message names the call, its group and number,
   the step, phase and micro-batch, then each member that did not arrive: one whose count on
   this group is below the call's number never issued it (it skipped the call or is stuck
   before it), with the call it is stuck in; one that did not answer is dead, stopped or busy
   outside any collective (when the run has a directory, its heartbeat tells which:
   :mod:`gridshard.engine.control`). When every member is in the call, the transfer itself
   stalled: a link, not a rank.

Why by hand: torch's flight recorder numbers collectives the same way, but on NCCL only (its dump
is kept in the run directory: :func:`gridshard.mesh.init_distributed`), and it names no step,
micro-batch or axis.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from ..errors import GridshardError

#: how long a rank that timed out waits for the other members' positions
ANSWER_S = 10.0
_KEY = "gridshard/timeout/rank{}"


class CollectiveTimeout(GridshardError, RuntimeError):
    """A collective waited past ``train.collective_timeout_s``; the message says which and who is
    missing (module docstring)."""


def _timed_out(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a backend's collective timeout (gloo's "Timed out waiting … ms", NCCL's
    watchdog "timeout") or a member closing its connection mid-collective (gloo's "Connection
    closed by peer": the member's own wait timed out first, or it died), not one of gridshard's own
    errors."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and not isinstance(error, GridshardError) and \
        (_timed_out(error) or "closed by peer" in text or "reset by peer" in text)


def position(ledger, ranges, rank: int) -> dict:
    """What this rank publishes (module docstring, step 1): JSON-ready."""
    last = ledger.last
    where = ranges.where() if ranges is not None else {}
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
            "call": None if last is None else last.row(),
            "calls": [[name, list(ranks), n] for (name, ranks), n in ledger.calls.items()], **where}


def explain_timeout(error: BaseException, ledger, ranges, rank: int, timeout_s: float, store=None,
                    answer_s: float = ANSWER_S) -> CollectiveTimeout:
    """The :class:`CollectiveTimeout` to raise for ``error`` on ``rank`` (module docstring). ``store``:
    the process group's store (None: the peers' positions are not asked for)."""
    mine = position(ledger, ranges, rank)
    call = mine["call"]
    head = (f"a collective timed out after {timeout_s:g} s (train.collective_timeout_s) on rank {rank}"
            if _timed_out(error) else f"a collective broke off on rank {rank} (a member closed its connection: its own "
            f"wait timed out first, or it died)")
    if call is None:
        return CollectiveTimeout(f"{head}, before any collective gridshard records ({_where(mine)}): {error}")
    members = [m for m in call["ranks"] if m != rank]
    answers = _exchange(store, mine, members, min(answer_s, timeout_s)) if store is not None else None
    text = (f"{head}: {_call(call)}, this rank's call #{call['number']} on that group"
            f"{' (waiting for its result)' if call['waiting'] else ''}, {_where(mine)}")
    if answers is None:
        return CollectiveTimeout(f"{text}. The other members' positions are unknown (no store to ask): see each "
                                 f"rank's log. Backend: {error}")
    notes = []
    for m in members:
        theirs = answers.get(m)
        if theirs is None:
            notes.append(f"rank {m}, which did not answer in {min(answer_s, timeout_s):g} s (dead, stopped, or busy "
                         f"outside any collective)")
            continue
        issued, at = _count(theirs, call), theirs.get("call") or {}
        if [at.get(k) for k in ("op", "axis", "ranks", "number")] == [call[k] for k in ("op", "axis", "ranks", "number")]:
            continue                                              # it is in this call too
        if issued < call["number"]:
            how = f"never issued call #{call['number']} on this group (it has issued {issued})"
        else:
            how = f"issued it (it has issued {issued} on this group)"
        notes.append(f"rank {m}, which {how} and is in {_call(at)}" + (f", its call #{at['number']} there" if at else "")
                     + f", {_where(theirs)}")
    if not notes:
        return CollectiveTimeout(f"{text}. Every member is in this call: the transfer itself stalled (a slow or "
                                 f"broken link between them, or an overloaded network). Backend: {error}")
    return CollectiveTimeout(f"{text}. Did not arrive: " + "; ".join(notes) + f". Backend: {error}")


def _exchange(store, mine: dict, members: list, answer_s: float) -> Optional[dict]:
    """Publish ``mine`` and collect the ``members``' positions for up to ``answer_s`` seconds;
    {rank: position} (those that answered), or None when the store cannot be reached."""
    try:
        store.set(_KEY.format(mine["rank"]), json.dumps(mine))
        deadline, answers = time.monotonic() + answer_s, {}
        while True:
            for m in members:
                if m not in answers and store.check([_KEY.format(m)]):
                    answers[m] = _read(store.get(_KEY.format(m)))
            if len(answers) == len(members) or time.monotonic() > deadline:
                return {m: a for m, a in answers.items() if a is not None}
            time.sleep(0.2)
    except (RuntimeError, ValueError, OSError):       # the store's host is gone too
        return None


def _read(raw: bytes) -> Optional[dict]:
    """A peer's published position, checked before use (bytes from another process are data)."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(value, dict) and isinstance(value.get("calls"), list) and \
        (value.get("call") is None or isinstance(value.get("call"), dict))
    return value if ok else None


def _count(theirs: dict, call: dict) -> int:
    """How many calls the member that published ``theirs`` has issued on ``call``'s group."""
    for entry in theirs["calls"]:
        if isinstance(entry, list) and len(entry) == 3 and entry[0] == call["axis"] and entry[1] == call["ranks"]:
            return int(entry[2])
    return 0


def _call(call: Optional[dict]) -> str:
    if not call:
        return "no collective gridshard records"
    ranks = call["ranks"]
    return f"{call['op']} on the {call['axis']} axis (ranks {', '.join(str(r) for r in ranks)})"


def _where(pos: dict) -> str:
    step, phase, micro = pos.get("step"), pos.get("phase"), pos.get("micro_batch")
    if step is None:
        return "outside the training loop"
    text = f"step {step}"
    if phase:
        text += f", in {phase}" + (f" of micro-batch {micro}" if micro is not None else "")
    return text
