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
