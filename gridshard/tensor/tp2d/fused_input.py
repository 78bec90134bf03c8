"""2D's shared-input product (:mod:`gridshard.parallel.shared_input`): one SUMMA A·B of x with
B = [W_q | W_k | W_v] (column j of the grid holds block j of every part), each part's bias gathered."""
from __future__ import annotations

from .linear import Linear2D, gather_vector_2d
from .summa import summa_ab_parts


def fusion(children):
    """(prepare, compute, input width) for Linear2D children, else None."""
    if any(type(c) is not Linear2D for c in children):
        return None
    return (lambda _, x: x), _fused_2d, children[0].in_local


def _fused_2d(children, x):
    first = children[0]
    y = summa_ab_parts(x.reshape(-1, first.in_local), [c.weight for c in children], first.mesh, first.overlap)
    y = y.view(*x.shape[:-1], y.shape[-1])
    outs = y.split([c.out_local for c in children], -1)
    return [o.contiguous() if c.bias is None else o + gather_vector_2d(c.bias, c.mesh, cache=c.vector_cache)
            for o, c in zip(outs, children)]
