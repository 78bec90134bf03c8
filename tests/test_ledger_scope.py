"""The ledger is scoped: a mesh built with its own ledger records there and nowhere else,
two jobs' meshes in one process never mix, and blind spots are listed."""
import torch

from gridshard.comm import LEDGER, CommLedger, use_ledger
from gridshard.comm import collectives as C
from gridshard.mesh import build_mesh
from gridshard.testing import run_on_ranks


def _two_jobs():
    LEDGER.reset()
    a, b = CommLedger(), CommLedger()
    mesh_a = build_mesh(1, 1, 2, "1d", ledger=a)
    mesh_b = build_mesh(2, 1, 1, "none", ledger=b)
    C.all_reduce(torch.ones(8), mesh_a.tensor)                      # 32 B on job a's tensor axis
    C.all_gather(torch.ones(3), mesh_b.data, 0)                     # 24 B gathered on job b's data axis
    pending = C.all_reduce(torch.ones(4), mesh_a.tensor, async_op=True)
    pending.wait()
    other = CommLedger()
    with use_ledger(other):                                         # the default mesh follows the scope
        C.all_reduce(torch.ones(2), build_mesh(1, 1, 2, "1d").tensor)
    return (a.count(), a.payload_bytes("all_reduce", "tensor"), a.count(axis="data"),
            b.count(), b.payload_bytes("all_gather", "data"), other.count(), LEDGER.count())


def test_meshes_record_into_their_own_ledgers():
    for got in run_on_ranks(2, _two_jobs):
        assert got == (2, 32 + 16, 0, 1, 24, 1, 0), got


def test_untracked_components_are_listed():
    ledger = CommLedger()
    ledger.note_untracked("torch.distributed.checkpoint")
    assert "not recorded (collectives of): torch.distributed.checkpoint" in ledger.summary()
    ledger.reset()
    assert "not recorded" not in ledger.summary()
