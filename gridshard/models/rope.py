"""Rotary position embedding (rotate-half form) on [b, heads, s, head_dim] tensors."""
import torch

from ..context.sequence_split import global_positions

TABLE_DTYPE = torch.float32


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0, device=None):
    """cos, sin tables of shape [s, head_dim] (float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=TABLE_DTYPE, device=device) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=TABLE_DTYPE, device=device), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d] rotated by position: x·cos + rotate_half(x)·sin; cos, sin [≥ s, d] (rows
    0 … s − 1 used) or [b, s, d] (each token's own rows: packed windows' positions per document)."""
    s = x.shape[-2]
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    else:
        cos, sin = cos[:s], sin[:s]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RopeTableCache:
    """The (cos, sin) tables a model's forward reads, built once per
    (seq_len, head_dim, theta, device, dtype) instead of once per forward; a model holds one
    (an instance attribute: no process-global state, not a buffer, so not in ``state_dict`` or
    checkpoints). A hit returns the very tensors :func:`rope_tables` built (in fp32, then cast to
    the ``dtype`` asked for: the activations' dtype, so :func:`apply_rope` makes no per-call copy),
    so values are the same bit for bit as casting at every call. Tables are built outside
    inference mode and without autograd, so a table first built under ``torch.inference_mode``
    can still be saved for backward later. Size: 2·s·d·e bytes per key, e the dtype's size (the
    ``rope_tables`` term of :mod:`gridshard.theory.memory`: held once, not per micro-batch)."""

    def __init__(self):
        self.tables: dict = {}

    def get(self, seq_len: int, head_dim: int, theta: float, device, dtype: torch.dtype = TABLE_DTYPE,
            context: tuple = (1, 0)) -> tuple:
        """``context`` = (C, rank): the ``seq_len`` = 2c tokens are context rank ``rank``'s chunks of
        a sequence of C·seq_len tokens, and the rows are the tables' at their global positions
        (:func:`gridshard.context.sequence_split.global_positions`); (1, 0): positions 0 … s − 1."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        key = (seq_len, head_dim, float(theta), device, tuple(context), dtype)
        hit = self.tables.get(key)
        if hit is None:
            C, rank = context
            with torch.inference_mode(False), torch.no_grad():
                cos, sin = rope_tables(seq_len * C, head_dim, theta, device=device)
                if C > 1:
                    at = global_positions(seq_len, C, rank, device=device)
                    cos, sin = cos[at], sin[at]
                hit = self.tables[key] = (cos.to(dtype), sin.to(dtype))
        return hit
