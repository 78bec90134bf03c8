"""Rotary position embedding (rotate-half form) on [b, heads, s, head_dim] tensors."""
import torch


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0, device=None):
    """cos, sin tables of shape [s, head_dim] (float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by position: x·cos + rotate_half(x)·sin."""
    s = x.shape[-2]
    cos, sin = cos[:s].to(x.dtype), sin[:s].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
