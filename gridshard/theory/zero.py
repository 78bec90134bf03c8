"""ZeRO over the data dimension: bytes moved per step and model-state bytes per rank.

Notation (per rank, fp32, :mod:`gridshard.zero.data_parallel`): the rank's trainable
parameters are grouped into units u (one per decoder layer, one *root* unit with the
embedding, final norm and head); a parameter with a local block of n0 rows of R elements
contributes c·R elements to each of the D equal segments of its unit's flat buffer,
c = ceil(n0/D), so the buffer has

    S_u = D · Σ_{p∈u} c_p · R_p  elements  (= the unit's local elements, plus row padding).

**Per optimizer step, A micro-batches, L_r decoder-layer units on this rank** (payload bytes
as the ledger records them: the unscattered input of a reduce-scatter, the gathered output
of an all-gather; b = bytes per element):

* ZeRO-1 and ZeRO-2: every unit once — reduce-scatter of S_u·b (gradients, after the last
  micro-batch) and all-gather of S_u·b (the updated rows). On a ring each moves
  (D−1)/D·S_u·b, together 2(D−1)/D·S_u·b: the all-reduce of ZeRO-0 (whose payload is the
  unpadded Σ n elements), up to padding.
* ZeRO-3: per micro-batch, an all-gather of every decoder layer in forward and again in
  backward; the root unit once per step (it stays gathered from its first use to the
  step's reduction: the head is the first thing every backward needs and the embedding the
  first thing every forward needs); then one reduce-scatter per unit per step:

      all_gather  = (A · 2 · Σ_layers S_u + S_root) · b,   reduce_scatter = Σ_u S_u · b

  With one micro-batch that is 3 transfers of the model against ZeRO-1/2's 2: the +50%
  of the ZeRO paper (the root unit's backward gather saved).

Clipping adds one 8-byte all-reduce over data (the shards' sum of squares).

**Model state at the end of a step** (after the optimizer, before the next zero_grad),
per parameter with n local elements, s = its owned rows' elements (≈ n/D), p = c·R (its
padded segment), fp32 (bf16/fp16 autocast keeps fp32 parameters, gradients and
moments):

====  ================  ==================  ===========
ZeRO  parameters        gradients           AdamW
====  ================  ==================  ===========
0     4n                4n                  8n
1     4n                4n + 4p (reduced)   8s
2     4n                4p                  8s
3     4p (flat shard)   4p                  8s
====  ================  ==================  ===========

(the reduced segment is the reduce-scatter's output, padded; each shard's gradient is a
view into it). Summed over a model, 16 bytes per element at ZeRO-0 become
4 + 4 + 8/D at ZeRO-1 (plus the reduced segment), 4 + 12/D at ZeRO-2 and 16/D at ZeRO-3.
"""
from __future__ import annotations

import math

from . import CommVolume


def zero_step_comm(layer_units: list, root_unit: int, data: int, stage: int, micro_batches: int = 1,
                   bytes_per_elem: int = 4) -> CommVolume:
    """One step's ZeRO collectives over the data axis (module docstring). ``layer_units``: S_u
    of each decoder-layer unit on this rank; ``root_unit``: S_root (0 if none)."""
    vol = CommVolume(data)
    units = list(layer_units) + ([root_unit] if root_unit else [])
    if stage in (1, 2):
        for s in units:
            vol.add("reduce_scatter", s * bytes_per_elem)
            vol.add("all_gather", s * bytes_per_elem)
    elif stage == 3:
        for s in units:
            vol.add("reduce_scatter", s * bytes_per_elem)
        for s in layer_units:
            vol.add("all_gather", s * bytes_per_elem, calls=2 * micro_batches)
        if root_unit:
            vol.add("all_gather", root_unit * bytes_per_elem)
    else:
        raise ValueError(f"zero_step_comm: stage {stage} is not 1, 2 or 3 (ZeRO-0: training.dp_gradient_allreduce)")
    return vol


def model_state_bytes(shapes: list, data: int, rank: int, stage: int) -> dict:
    """Bytes of parameters, gradients and AdamW moments data rank ``rank`` of ``data`` holds at
    a step's end (module docstring's table); ``shapes``: the local block shape of each trainable
    parameter (tied weights once)."""
    from ..zero.rows import padded_numel, shard_numel

    params = grads = optim = 0
    for shape in shapes:
        n = math.prod(shape)
        s, p = shard_numel(shape, data, rank), padded_numel(shape, data)
        if stage == 0:
            params, grads, optim = params + 4 * n, grads + 4 * n, optim + 8 * n
        elif stage == 1:
            params, grads, optim = params + 4 * n, grads + 4 * n + 4 * p, optim + 8 * s
        elif stage == 2:
            params, grads, optim = params + 4 * n, grads + 4 * p, optim + 8 * s
        elif stage == 3:
            params, grads, optim = params + 4 * p, grads + 4 * p, optim + 8 * s
        else:
            raise ValueError(f"model_state_bytes: stage {stage} is not 0–3")
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
