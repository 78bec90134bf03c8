"""Every recorded call takes one route (:func:`gridshard.comm.ledger.record`), and pausing
belongs to that route: a pause stops recording into every ledger, the mesh's own included.

Before the route was one, ``LEDGER.paused()`` paused only the context-variable ledger while
collectives on a job's mesh went to the mesh's ledger, so ``gathered_state_dict`` of a model
on a trainer's mesh was counted in the trainer's ledger although it is outside the ledger."""
import torch

from gridshard.comm import LEDGER, CommLedger, use_ledger
from gridshard.comm import collectives as C
from gridshard.mesh import build_mesh
from gridshard.testing import run_on_ranks


def _tiny_model():
    from gridshard.models import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn_hidden=48, max_seq_len=8)
    with torch.device("meta"):
        return Transformer(cfg)


def _gather_on_a_jobs_mesh():
    from gridshard import gathered_state_dict, parallelize

    job = CommLedger()                                              # as the trainer builds its mesh
    mesh = build_mesh(1, 1, 2, "1d", ledger=job)
    model = parallelize(_tiny_model(), mesh, seed=0, device="cpu")
    job.reset()
    state = gathered_state_dict(model)
    C.all_reduce(torch.ones(4), mesh.tensor)                        # recording resumes after the gather
    return len(state), job.count(), job.payload_bytes("all_reduce", "tensor"), LEDGER.count()


def test_gathered_state_dict_stays_out_of_the_jobs_ledger():
    for n, count, all_reduce_bytes, default_count in run_on_ranks(2, _gather_on_a_jobs_mesh):
        assert n > 0
        assert (count, all_reduce_bytes, default_count) == (1, 16, 0), (count, all_reduce_bytes, default_count)


def _pause_covers_every_ledger():
    LEDGER.reset()
    job, scoped = CommLedger(), CommLedger()
    bound = build_mesh(1, 1, 2, "1d", ledger=job)
    free = build_mesh(1, 1, 2, "1d")
    with use_ledger(scoped):
        for pause in (LEDGER.paused, job.paused, CommLedger().paused):
            with pause():
                C.all_reduce(torch.ones(2), bound.tensor)
                C.all_gather(torch.ones(2), free.tensor, 0)
        C.all_reduce(torch.ones(2), bound.tensor)                   # after the pauses both routes record
        C.all_gather(torch.ones(2), free.tensor, 0)
    return job.count(), scoped.count(), LEDGER.count()


def test_a_pause_covers_the_mesh_ledger_and_the_current_one():
    for got in run_on_ranks(2, _pause_covers_every_ledger):
        assert got == (1, 1, 0), got
