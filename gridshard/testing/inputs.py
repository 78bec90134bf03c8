"""Seeded random inputs for tests: the same seed gives the same tensor on every rank."""
import torch


def randn(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Standard normal tensor of ``shape`` from its own generator seeded with ``seed`` (× ``scale``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def randint(high: int, shape, seed: int) -> torch.Tensor:
    """Integers in [0, high) of ``shape`` from their own generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g)
