"""2D and 3D tensor parallelism in low precision (CPU bf16 here; a GPU's fp16 takes the same code):

* **autocast over fp32 parameters** (``train.precision: fp16``'s layout): forward and backward of the
  whole model at q = 2 give the one-process model's loss and every gathered gradient under the same
  autocast, within bf16 rounding. The 3D product's backward used to stop here: autograd runs a
  backward outside autocast, where the bf16 dY met the fp32 weight block it had saved
  (:func:`gridshard.tensor.tp3d.matmul.compute_dtype` now casts the operands before their gathers,
  in forward and backward alike);
* **bf16 storage** (``train.precision: bf16``: parameters in bf16 under autocast): the ledger of one
  forward and backward equals the scheme's ``tensor_comm`` at e = 2, call for call and byte for
  byte: the volume the planner prices (products' blocks, vectors and embedding in bf16; norm
  statistics and the loss in fp32; tokens int64). Priced at 4 bytes, as before, it was twice this.
"""
import pytest
import torch

from gridshard.models import ModelConfig
from gridshard.planner.layouts import Layout
from gridshard.testing import run_on_ranks
from gridshard.tensor.tp2d.cost import tensor_comm_2d
from gridshard.tensor.tp3d.cost import tensor_comm_3d

B, S = 4, 8


def _cfg(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=96, max_seq_len=16,
                       tie_embeddings=tied, init_std=0.1)


def _low_precision(T: int, mode: str, tied: bool, seed: int) -> tuple:
    """({loss or parameter name: (relative error of the laid-out model's loss or gathered gradient
    under bf16 autocast over fp32 parameters, the one-process model's under the same autocast)},
    both against the one-process model in fp32; the ledger's (calls, payload) per (axis, op) of one
    forward + backward with the parameters stored in bf16)."""
    from gridshard import build_mesh, parallelize
    from gridshard.comm.ledger import CommLedger
    from gridshard.models import Transformer
    from gridshard.parallel import context_of, gather_canonical
    from gridshard.testing.compare import relative_error
    from gridshard.testing.inputs import randint

    def model():
        with torch.device("meta"):
            return Transformer(_cfg(tied))

    ledger = CommLedger()
    mesh = build_mesh(1, 1, T, mode, ledger=ledger)
    exact = parallelize(model(), build_mesh(T, 1, 1, "none"), seed=seed, device="cpu")
    ref = parallelize(model(), build_mesh(T, 1, 1, "none"), seed=seed, device="cpu")
    par = parallelize(model(), mesh, seed=seed, device="cpu")
    ctx = context_of(par)
    tokens, targets = randint(97, (B, S), seed + 1), randint(97, (B, S), seed + 2)

    def loss_of(m, c, tok, tgt, low=True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
            return c.model_loss(m, tok, tgt, reduction="sum")

    exact_loss = loss_of(exact, context_of(exact), tokens, targets, low=False)
    exact_loss.backward()
    ref_loss = loss_of(ref, context_of(ref), tokens, targets)
    ref_loss.backward()
    loss = loss_of(par, ctx, ctx.shard_tokens(tokens), ctx.shard_targets(targets))
    loss.backward()
    rel = lambda a, b: abs(float(a) - float(b)) / abs(float(b))  # noqa: E731
    errors = {"loss": (rel(loss, exact_loss), rel(ref_loss, exact_loss))}
    for name, p in par.named_parameters(remove_duplicate=False):
        assert p.grad.dtype == torch.float32, name
        want = exact.get_parameter(name).grad
        errors[name] = (relative_error(gather_canonical(p.grad, ctx.layouts[name], mesh), want),
                        relative_error(ref.get_parameter(name).grad, want))
    assert len(errors) == 1 + len(dict(ref.named_parameters(remove_duplicate=False))), "every parameter compared"

    for p in par.parameters():                    # bf16 storage, as the trainer keeps it
        p.grad, p.data = None, p.data.to(torch.bfloat16)
    ledger.reset()
    loss_of(par, ctx, ctx.shard_tokens(tokens), ctx.shard_targets(targets)).backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in par.parameters())
    return errors, {(e.axis, e.op): (e.count, e.payload_bytes) for e in ledger.entries.values()}


def _check_errors(results, what):
    """Every gathered gradient and the loss are as close to fp32 as the one-process model under the same
    autocast is, within a factor: bf16 rounds to 2⁻⁸ relative, and the blocked products add the same
    terms in another order (measured: at most about 1.3× the one-process error)."""
    errors = results[0][0]
    assert all(r[0] == errors for r in results), f"{what}: the ranks disagree on the gathered errors"
    ratio = {k: par / max(ref, 1e-3) for k, (par, ref) in errors.items()}
    worst = max(ratio, key=ratio.get)
    assert ratio[worst] < 2, f"{what}: {worst} under bf16 autocast: {errors[worst][0]:.3g} from fp32 against " \
                             f"{errors[worst][1]:.3g} for one process"
    print(f"{what}: worst {worst} {errors[worst][0]:.2e} from fp32 against {errors[worst][1]:.2e} for one process")


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.wide)], ids=["untied", "tied"])
def test_2d_under_autocast_and_its_bf16_ledger_is_the_priced_volume(tied):
    results = run_on_ranks(4, _low_precision, 4, "2d", tied, 7)
    _check_errors(results, f"2D q=2 tied={tied}")
    priced = tensor_comm_2d(_cfg(tied), Layout(1, 1, 4, "2d", False, 0, "none", B), S, 2, True, True, e=2)
    want = {}
    for v in priced:
        for op in v.calls:
            calls, payload = want.get(op, (0, 0))
            want[op] = (calls + v.calls[op], payload + v.payload[op])
    for ledger in (r[1] for r in results):
        assert {a for a, _ in ledger} <= {"row", "col"}, ledger
        got = {}
        for (_, op), (calls, payload) in ledger.items():
            c0, p0 = got.get(op, (0, 0))
            got[op] = (c0 + calls, p0 + payload)
        assert got == want, (tied, got, want)


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.wide)], ids=["untied", "tied"])
def test_3d_under_autocast_and_its_bf16_ledger_is_the_priced_volume(tied):
    results = run_on_ranks(8, _low_precision, 8, "3d", tied, 11)
    _check_errors(results, f"3D q=2 tied={tied}")
    priced = tensor_comm_3d(_cfg(tied), Layout(1, 1, 8, "3d", False, 0, "none", B), S, 2, True, True, e=2)
    want = {(a, op): (v.calls[op], v.payload[op]) for a, v in priced.items() for op in v.calls}
    assert all(r[1] == want for r in results), (tied, results[0][1], want)
