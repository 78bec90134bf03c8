"""Comparison against a single-process reference with a relative-error bound."""
import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / max(‖expected‖, tiny), in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, what: str = "tensor") -> None:
    """Assert equal shapes and relative Frobenius error ≤ ``rtol``; the message names ``what``."""
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}"
    err = relative_error(actual, expected)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def max_rel(actual, expected) -> float:
    """The largest ``|a − e| / |e|`` over the pairs of two sequences of numbers (per-step losses,
    gradient norms), paired with ``zip`` (the shorter one sets the length)."""
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected))


def max_rel_tensors(actual, expected, *, dtype: torch.dtype | None = torch.float64, floor: float = 0.0,
                    floating_only: bool = False) -> float:
    """The largest relative Frobenius error ``‖actual[k] − expected[k]‖ / max(‖expected[k]‖, floor)``
    over the keys of ``expected`` (two mappings of tensors: state dicts, optimizer moments).

    ``dtype``: both sides are converted to it first (None: computed in the tensors' own dtype);
    ``floor``: the least denominator (0: none, a zero reference norm divides by zero);
    ``floating_only``: leave out the keys whose expected tensor is not floating point (step counters)."""
    errors = []
    for k, e in expected.items():
        if floating_only and not e.dtype.is_floating_point:
            continue
        a = actual[k]
        if dtype is not None:
            a, e = a.to(dtype), e.to(dtype)
        norm = e.norm()
        errors.append(float((a - e).norm() / (norm.clamp_min(floor) if floor else norm)))
    return max(errors)
