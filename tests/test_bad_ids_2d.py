"""A bad token id or target in ONE batch block of a 2D grid: every rank raises the same
error at once, none waits in a collective for the process-group timeout.

Token ids and targets of batch block i live only on grid row i. Before the fix, the row
holding a bad id raised while the other rows went on into the embedding's all-gather or
the loss's column all-reduce and hung there. For q = 2 (4 ranks) and q = 3 (9 ranks), each
block position i, each 2D layer that reads ids (``VocabParallelEmbedding2D`` tokens,
``Embedding2D`` tokens, ``cross_entropy_2d`` targets) and an id past either end of the
vocabulary, every rank must raise a ``ShapeError`` with the identical message naming the id
and block i, all within one second of each other; a clean call afterwards must still
work (the group's collectives stayed in step). All cases of one q run in one call of the
reused worker group; a hang fails at the harness timeout (60 s) with the stuck stacks.

The one-second bound: the ranks raise right after the same collective, so their raise
times differ by scheduling only (measured ≤ 0.012 s with 9 ranks on the shared 2-core machine).
"""
import time

import pytest

from gridshard.errors import ShapeError
from gridshard.tensor.tp2d.cross_entropy import cross_entropy_2d
from gridshard.tensor.tp2d.embedding import Embedding2D, VocabParallelEmbedding2D
from gridshard.testing import run_on_ranks
from gridshard.testing.inputs import randint, randn

from .test_tp2d_helpers import mesh_2d

V, S = 11, 3
SPREAD_S = 1.0


def _cases(q):
    """(layer, position of the bad block, bad id): both ends of the vocabulary, every block."""
    return [(layer, pos, bad) for layer in ("VocabParallelEmbedding2D", "Embedding2D", "cross_entropy_2d")
            for pos in range(q) for bad in (V + pos, -1 - pos)]


def _bad_ids(q):
    mesh = mesh_2d(q)
    b = 2 * q                                              # two rows per batch block
    i = mesh.grid_row
    emb = VocabParallelEmbedding2D(V, 2 * q, mesh)
    emb_full = Embedding2D(V, 2 * q * q, mesh)
    logits = randn((b // q, S, -(-V // q)), 5)             # this rank's block of [b, S, V_pad]
    out = []
    for layer, pos, bad in _cases(q):
        ids = randint(V, (b, S), 3)
        ids[pos * (b // q) + 1, S - 1] = bad               # one bad id, in batch block pos only
        mine = ids.chunk(q, 0)[i]
        try:
            if layer == "cross_entropy_2d":
                cross_entropy_2d(logits, mine, mesh, V)
            elif layer == "Embedding2D":
                emb_full(mine)
            else:
                emb(mine)
            out.append(None)
        except ShapeError as e:
            out.append((str(e), time.time()))
    clean = randint(V, (b, S), 4).chunk(q, 0)[i]
    loss = cross_entropy_2d(logits, clean, mesh, V)        # the group is still in step
    emb(clean), emb_full(clean)
    return out, float(loss)


# q = 3 (9 ranks) in make test-all: make test keeps q = 2, the representative
@pytest.mark.parametrize("q", [2, pytest.param(3, marks=pytest.mark.wide)], ids=["q2", "q3"])
def test_bad_id_in_one_batch_block_raises_on_every_rank(q):
    per_rank = run_on_ranks(q * q, _bad_ids, q, timeout=60)
    assert len({loss for _, loss in per_rank}) == 1, "ranks disagree on the clean loss afterwards"
    worst = 0.0
    for n, (layer, pos, bad) in enumerate(_cases(q)):
        got = [out[n] for out, _ in per_rank]
        what = f"q={q} {layer}, id {bad} in batch block {pos}"
        assert all(g is not None for g in got), f"{what}: some ranks did not raise: {got}"
        messages = {m for m, _ in got}
        assert len(messages) == 1, f"{what}: ranks raised different errors: {messages}"
        msg = messages.pop()
        assert msg.startswith(f"{layer}") and f"id {bad} is outside the vocabulary [0, {V})" in msg, msg
        assert f"in batch block {pos};" in msg and "Fix:" in msg, msg
        times = [t for _, t in got]
        worst = max(worst, max(times) - min(times))
        assert max(times) - min(times) < SPREAD_S, f"{what}: raise times spread {max(times) - min(times):.2f} s"
    print(f"q={q}: {len(_cases(q))} cases, largest spread of raise times {worst:.3f} s")
