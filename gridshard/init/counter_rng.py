"""Counter-based random numbers: layout-independent parameter initialisation.

Why counter-based
-----------------
Initial values must be a pure function ``value = f(seed, key, i)`` of the run seed, the
parameter's canonical name ``key`` and the *global* flat (row-major) element index ``i``.
Then any rank can materialise only its shard of a global tensor with O(shard) work and
memory, and get bit-identical values to a single process that builds the whole tensor,
whatever the layout, chunking, device or thread count. torch's CPU generator (mt19937)
is sequential: reaching element ``i`` means drawing the ``i`` values before it, so it
cannot skip ahead. A counter-based generator (Salmon et al., "Parallel random numbers:
as easy as 1, 2, 3", SC'11) has no state: element ``i`` is a hash of ``(key, i)``.

The math
--------
*Key.* ``k = key_hash(seed, key)`` is 63 bits of BLAKE2b over the text
``"<seed>\\0<key>"`` (stable across processes, unlike Python's salted ``hash``). Each
stream ``s`` gets two 32-bit round keys ``(a_s, b_s)``: the two halves of BLAKE2b over
``(k, s)``. Values depend on ``(seed, key)`` only through ``k``.

*Counter hash.* All arithmetic is on int64 tensors holding 32-bit values, with
``M = 2**32 - 1``. One mixing round is lowbias32's shape (C. Wellons, hash-prospector)
with both multipliers odd and ``< 2**31``, so a product of a 32-bit value and a
multiplier is ``< 2**63`` and never overflows int64::

    mix(x) = x ^= x >> 16;  x = (x * 0x7feb352d) & M
             x ^= x >> 15;  x = (x * 0x297a2d39) & M
             x ^= x >> 16

Each step (xor-shift, multiplication by an odd number mod 2**32) is a bijection of the
32-bit values, so ``mix`` is a permutation. Both halves of the index are mixed in, so
tensors with more than 2**32 elements still get distinct inputs (``0 <= i < 2**63``)::

    lo = i & M,  hi = i >> 32
    h_s(i) = mix(mix(lo ^ a_s) ^ hi ^ b_s)          # a 32-bit integer

*Uniform.* ``u_s(i) = (2 h_s(i) + 1) / 2**33`` — the midpoints of the 2**32 cells of
[0, 1), so ``u`` lies in the open interval (0, 1), exactly representable in float64.

*Normal (Box–Muller).* With two independent uniforms from streams 0 and 1,
``z = sqrt(-2 ln u_0) · cos(2π u_1)`` is standard normal (only the cosine half is used:
each element has its own pair). Since ``u_0 >= 2**-33``, ``|z| <= sqrt(66 ln 2) ≈ 6.76``.

*Bit-exact everywhere.* ``torch.log``/``torch.cos`` may differ in the last bit between
vectorised and scalar code paths (which element of a chunk lands in a SIMD tail), between
libraries (SLEEF, MKL) and between devices. So ``ln`` and ``cos`` are computed here from
operations that IEEE 754 rounds correctly, hence identically everywhere (``+ - * /``,
``sqrt``, and the exact ``frexp``), in float64:

* ``ln u``: ``u = m · 2**e`` (``frexp``), folded to ``m ∈ [1/√2, √2)``; with
  ``s = (m - 1) / (m + 1)`` (``|s| <= 0.1716``),
  ``ln m = 2 atanh s = 2 s Σ_{j=0}^{10} s^{2j} / (2j + 1)`` (truncation < 1e-18), and
  ``ln u = e ln 2 + ln m``.
* ``cos(2π u)``: with the odd integer ``A = 2h + 1`` (``u = A / 2**33``), fold exactly in
  integers using evenness and ``cos(π - x) = -cos x``: ``A' = min(A, 2**33 - A)``
  (angle in (0, π]), then if ``A' > 2**31``: ``A' <- 2**32 - A'`` and flip the sign
  (angle in (0, π/2]). With ``x = A' · π / 2**32 ∈ (0, π/2]``,
  ``cos x = Σ_{j=0}^{10} (-1)^j x^{2j} / (2j)!`` (truncation < 2e-17).

``normal`` values are formed in float64 as ``mean + std · z`` and then rounded once to the
requested dtype; ``z`` agrees with the ``torch.log``/``torch.cos`` formula to ~1e-14.

*Cost.* About 130 elementwise tensor ops per element, run over cache-sized pieces; on
one CPU thread roughly 10 M elements/s (eager torch, no compiled kernel).
"""
from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch

__all__ = ["key_hash", "uniform_at", "normal_at", "block_flat_indices", "fill_normal_"]

_M32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x297A2D39           # odd, < 2**31: products fit in int64
_LN2 = math.log(2.0)
# ln m = 2 s · Σ s^{2j} / (2j+1);  cos x = Σ (-1)^j x^{2j} / (2j)!   (j = 0..10)
_LOG_COEFFS = tuple(1.0 / (2 * j + 1) for j in range(11))
_COS_COEFFS = tuple((-1.0) ** j / math.factorial(2 * j) for j in range(11))
_MAX_INDEX = (1 << 63) - 1


def key_hash(seed: int, key: str) -> int:
    """Stable 63-bit integer of ``(seed, key)``: BLAKE2b-64 of ``"<seed>\\0<key>"``, top bit
    cleared. Equal in every process and on every platform (Python's ``hash`` is salted)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not isinstance(key, str):
        raise TypeError(f"key must be a str (the parameter's canonical name), got {type(key).__name__}")
    text = f"{seed}\0{key}".encode("utf-8")
    digest = hashlib.blake2b(text, digest_size=8, person=b"gridshard.init").digest()
    return int.from_bytes(digest, "little") >> 1


def _round_keys(k: int, stream: int) -> tuple[int, int]:
    """The two 32-bit round keys ``(a_s, b_s)`` of stream ``s``: BLAKE2b-64 of ``(k, s)``."""
    data = k.to_bytes(8, "little") + stream.to_bytes(4, "little")
    w = int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"gridshard.strm").digest(), "little")
    return w & _M32, w >> 32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """One lowbias32-shaped round on 32-bit values held in int64 (a bijection of [0, 2**32))."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def _check_index(flat_index: torch.Tensor) -> torch.Tensor:
    if not isinstance(flat_index, torch.Tensor) or flat_index.dtype != torch.int64:
        raise TypeError(f"flat_index must be a torch.int64 tensor, got "
                        f"{getattr(flat_index, 'dtype', type(flat_index).__name__)}")
    if flat_index.numel() and int(flat_index.min()) < 0:
        raise ValueError(f"flat_index must be >= 0 (global row-major element indices), "
                         f"got min {int(flat_index.min())}")
    return flat_index


def _odd_cells(k: int, stream: int, flat_index: torch.Tensor) -> torch.Tensor:
    """``A = 2 h_s(i) + 1`` (int64, odd, in (0, 2**33)) with the counter hash
    ``h_s(i) = mix(mix(lo ^ a_s) ^ hi ^ b_s)`` (32-bit values in int64); the uniform is ``A / 2**33``."""
    a, b = _round_keys(k, stream)
    return _mix32(_mix32((flat_index & _M32) ^ a) ^ (flat_index >> 32) ^ b) * 2 + 1


def _horner(t: torch.Tensor, coeffs: Sequence[float]) -> torch.Tensor:
    """``Σ_j coeffs[j] · t**j`` by Horner's rule (separate, correctly rounded mul and add)."""
    p = torch.full_like(t, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p.mul_(t).add_(c)
    return p


def _log(u: torch.Tensor) -> torch.Tensor:
    """``ln u`` for float64 ``u > 0`` from exact/correctly rounded ops only (see module doc)."""
    m, e = torch.frexp(u)                                  # u = m · 2**e, m ∈ [1/2, 1)
    small = m < math.sqrt(0.5)
    m = torch.where(small, m * 2, m)                        # m ∈ [1/√2, √2)
    e = (e - small.to(e.dtype)).to(torch.float64)
    s = (m - 1) / (m + 1)
    return e * _LN2 + 2 * s * _horner(s * s, _LOG_COEFFS)


def _cos_2pi(cells: torch.Tensor) -> torch.Tensor:
    """``cos(2π A / 2**33)`` for odd int64 ``A`` in (0, 2**33), folded exactly in integers."""
    a = torch.minimum(cells, (1 << 33) - cells)             # angle in (0, π]
    flip = a > (1 << 31)                                     # angle > π/2: cos(π - x) = -cos x
    a = torch.where(flip, (1 << 32) - a, a)                  # angle in (0, π/2]
    x = a.to(torch.float64) * (math.pi / (1 << 32))
    c = _horner(x * x, _COS_COEFFS)
    return torch.where(flip, -c, c)


def _standard_normal64(k: int, flat_index: torch.Tensor) -> torch.Tensor:
    """``z = sqrt(-2 ln u_0) · cos(2π u_1)`` in float64, same shape as ``flat_index``."""
    u0 = _odd_cells(k, 0, flat_index).to(torch.float64) * 2.0 ** -33   # exact
    r = torch.sqrt(_log(u0) * -2.0)
    return r * _cos_2pi(_odd_cells(k, 1, flat_index))


def _normal_into(out_flat: torch.Tensor, k: int, flat_index: torch.Tensor, std: float, mean: float) -> None:
    """``out_flat[j] = mean + std · z(flat_index[j])`` (both 1-D, same length), rounded once
    from float64 to ``out_flat.dtype``. Works in pieces (2**16 elements on CPU, 2**22 on a GPU):
    every op is elementwise, so pieces change nothing but speed (cache-sized temporaries instead
    of ~20 whole-size ones; on CPU 2**16 elements is ~20x faster than 2**24 at once)."""
    piece = 1 << 16 if out_flat.device.type == "cpu" else 1 << 22
    for p0 in range(0, flat_index.numel(), piece):
        z = _standard_normal64(k, flat_index[p0:p0 + piece])
        out_flat[p0:p0 + piece].copy_(z * std + mean)


def uniform_at(seed: int, key: str, flat_index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Uniform values in the open interval (0, 1) at global flat indices, float64.

    ``u_s(i) = (2 h_s(i) + 1) / 2**33`` (exact in float64; a float32 copy could round the
    largest values up to 1.0). ``stream`` selects an independent stream; ``normal_at``
    uses streams 0 and 1. Same shape and device as ``flat_index`` (int64, values >= 0).
    """
    _check_index(flat_index)
    return _odd_cells(key_hash(seed, key), stream, flat_index).to(torch.float64) * 2.0 ** -33


def normal_at(seed: int, key: str, flat_index: torch.Tensor, std: float = 1.0, mean: float = 0.0,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal(mean, std²) values at global flat indices: ``mean + std · z(i)`` with the
    Box–Muller ``z`` of the module doc, formed in float64 and rounded once to ``dtype``.
    Same shape and device as ``flat_index`` (int64, values in [0, 2**63))."""
    _check_index(flat_index)
    out = torch.empty(flat_index.shape, dtype=dtype, device=flat_index.device)
    _normal_into(out.view(-1), key_hash(seed, key), flat_index.reshape(-1), float(std), float(mean))
    return out


def _row_major_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def _as_index_lists(global_shape: Sequence[int], dim_indices, device=None) -> list[torch.Tensor]:
    """Validate the per-dim index lists against ``global_shape``; int64 1-D tensors on ``device``."""
    shape = [int(n) for n in global_shape]
    if len(dim_indices) != len(shape):
        raise ValueError(f"dim_indices has {len(dim_indices)} index lists but global_shape "
                         f"{tuple(shape)} has {len(shape)} dims: give one list per dim")
    if math.prod(shape) - 1 > _MAX_INDEX:
        raise ValueError(f"global_shape {tuple(shape)} has more than 2**63 elements")
    out = []
    for d, (n, ix) in enumerate(zip(shape, dim_indices)):
        ix = torch.as_tensor(ix, dtype=torch.int64, device=device)
        if ix.dim() != 1:
            raise ValueError(f"dim_indices[{d}] must be 1-D, got shape {tuple(ix.shape)}")
        if ix.numel() and (int(ix.min()) < 0 or int(ix.max()) >= n):
            raise ValueError(f"dim_indices[{d}] must lie in [0, {n}) (global_shape[{d}] = {n}), "
                             f"got values in [{int(ix.min())}, {int(ix.max())}]")
        out.append(ix)
    return out


def _flat(strides: Sequence[int], index_lists: Sequence[torch.Tensor], base: int = 0) -> torch.Tensor:
    """``base + Σ_d ix_d · stride_d`` over the Cartesian product, shape ``(len(ix_d))_d``."""
    if not index_lists:
        return torch.tensor(base, dtype=torch.int64)
    flat = index_lists[0] * strides[0] + base
    for ix, st in zip(index_lists[1:], strides[1:]):
        flat = flat.unsqueeze(-1) + ix * st
    return flat


def block_flat_indices(global_shape: Sequence[int], dim_indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """Global row-major flat indices of a block, the Cartesian product of per-dim index lists.

    ``out[j_0, …, j_{n-1}] = Σ_d dim_indices[d][j_d] · stride_d`` with
    ``stride_d = Π_{e>d} global_shape[e]``; shape ``tuple(len(ix) for ix in dim_indices)``.
    Lists may be non-contiguous or unordered (e.g. ``[0, 3, 1]``).
    """
    ixs = _as_index_lists(global_shape, dim_indices)
    return _flat(_row_major_strides(global_shape), ixs)


def fill_normal_(out: torch.Tensor, seed: int, key: str, global_shape: Sequence[int], dim_indices,
                 std: float, mean: float = 0.0, chunk_elems: int = 1 << 22) -> torch.Tensor:
    """Write into ``out`` (the block's shape, any float dtype, any strides) exactly what
    ``normal_at(seed, key, block_flat_indices(global_shape, dim_indices), std, mean,
    out.dtype)`` would give, with at most ``chunk_elems`` elements in flight at a time.

    Chunks are runs of whole rows of the leading index list (``chunk_elems // inner``
    rows, ``inner`` = elements per row); when one row alone exceeds ``chunk_elems`` the
    rows are filled one by one, recursively. Per chunk the temporaries are its int64 flat
    indices (plus a staging copy in ``out.dtype`` when ``out`` is not contiguous) and
    fixed-size float64 pieces, so peak extra memory is O(chunk_elems), never O(block).
    ``std``/``mean`` scale the standard normal as in ``normal_at``. Returns ``out``.
    """
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    ixs = _as_index_lists(global_shape, dim_indices, device=out.device)
    block_shape = tuple(len(ix) for ix in ixs)
    if tuple(out.shape) != block_shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but the block given by dim_indices "
                         f"has shape {block_shape}")
    if not out.is_floating_point():
        raise TypeError(f"out must be a floating-point tensor, got {out.dtype}")
    k, std, mean = key_hash(seed, key), float(std), float(mean)
    with torch.no_grad():
        _fill_block(out, k, std, mean, _row_major_strides(global_shape), ixs, 0, chunk_elems)
    return out


def _fill_block(out: torch.Tensor, k: int, std: float, mean: float, strides: list[int],
                ixs: list[torch.Tensor], base: int, chunk_elems: int) -> None:
    """Fill ``out`` (block over ``ixs``, flat offset ``base`` from already fixed dims)."""
    if out.numel() == 0:
        return
    if not ixs or out.numel() <= chunk_elems:
        flat = _flat(strides, ixs, base).to(out.device).reshape(-1)
        dense = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        _normal_into(dense.view(-1), k, flat, std, mean)
        if dense is not out:
            out.copy_(dense)
        return
    inner = math.prod(len(ix) for ix in ixs[1:])
    if inner <= chunk_elems:                                  # runs of whole leading rows
        rows = chunk_elems // inner
        for r0 in range(0, len(ixs[0]), rows):
            _fill_block(out[r0:r0 + rows], k, std, mean, strides, [ixs[0][r0:r0 + rows]] + ixs[1:],
                        base, chunk_elems)
    else:                                                     # one row is too big: recurse per row
        for r, i in enumerate(ixs[0].tolist()):
            _fill_block(out[r], k, std, mean, strides[1:], ixs[1:], base + i * strides[0], chunk_elems)
