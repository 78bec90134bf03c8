"""Token / target id range checks that every rank of a group answers alike.

A data-dependent check (an id outside the vocabulary) is only safe in a parallel layer
when every rank that takes part in the layer's next collective reaches the same verdict.
If rank (0, j) of a 2D grid raises on a bad id in its batch block while rank (1, j), whose
block is clean, goes on into the layer's all-reduce, rank (1, j) waits there until the
process-group timeout. Two ways to agree, used by the layers:

* sum a small verdict vector over the group: member k of a group of n (k = its batch-block
  index) fills the slots of block k in a float64 vector of 2n entries

      v[k]     = 1 if block k holds an id outside [0, V) (``ignore_index`` excepted), else 0
      v[n + k] = that id: the largest one ≥ V if there is one, else the smallest one < 0

  and 0 elsewhere, so the group sum of v is every block's verdict, bit for bit the same on
  every member (float64 holds ids exactly up to 2^53). :func:`raise_on_bad_ids` then raises
  one :class:`ShapeError` naming the first bad block, its id, the rule and a fix on every
  member. ``cross_entropy_2d`` appends v to the column all-reduce it makes anyway (no extra
  collective); ``Embedding2D`` all-reduces it alone (16·n bytes);
* check data every rank holds (:func:`check_blocks`, the same vector built locally):
  :class:`gridshard.tensor.tp2d.embedding.VocabParallelEmbedding2D` all-gathers the tokens along
  the grid column anyway, so after that all-gather every rank of the tensor group holds
  the whole micro-batch and answers alike with no extra collective.

(1D layers need none of this: their tokens and targets are replicated over the tensor
group, so :func:`gridshard.tensor.tp1d.embedding.check_token_range` on them agrees already.)

On CUDA the verdict is a device-side assertion on the summed vector (no host sync), which
fails on every rank alike.
"""
from __future__ import annotations

import torch

from ..errors import ShapeError
from ..torch_private import assert_async


def bad_id_slots(ids: torch.Tensor, vocab_size: int, index: int, n: int, ignore_index=None) -> torch.Tensor:
    """The verdict vector [2n] float64 of block ``index`` of ``n`` (module docstring)."""
    v = torch.zeros(2 * n, dtype=torch.float64, device=ids.device)
    if ids.numel() == 0:
        return v
    live = torch.ones_like(ids, dtype=torch.bool) if ignore_index is None else ids != ignore_index
    high = live & (ids >= vocab_size)
    low = live & (ids < 0)
    lowest = torch.iinfo(ids.dtype).min
    biggest = ids.masked_fill(~high, lowest).max()
    smallest = ids.masked_fill(~low, 0).min()
    any_high = high.any()
    v[index] = (any_high | low.any()).to(torch.float64)
    v[n + index] = torch.where(any_high, biggest, smallest).to(torch.float64)
    return v


def check_blocks(ids: torch.Tensor, vocab_size: int, what: str, n: int, ignore_index=None,
                 block: str = "batch block") -> None:
    """The same check on ids every rank already holds whole ([n·m, ...], block k = rows
    k·m … (k+1)·m − 1): the summed verdict vector is built locally, no collective."""
    summed = sum(bad_id_slots(part, vocab_size, k, n, ignore_index) for k, part in enumerate(ids.chunk(n, 0)))
    raise_on_bad_ids(summed, vocab_size, what, ignore_index, block)


def raise_on_bad_ids(summed: torch.Tensor, vocab_size: int, what: str, ignore_index=None,
                     block: str = "batch block") -> None:
    """Raise one :class:`ShapeError` (the same on every rank that holds the same ``summed``)
    if any block's slot says it holds an id outside [0, vocab_size)."""
    n = summed.numel() // 2
    flags = summed[:n]
    if summed.is_cuda:
        assert_async(flags.sum() == 0, f"{what}: an id lies outside the vocabulary [0, {vocab_size})")
        return
    flags_list = flags.tolist()
    if not any(flags_list):
        return
    blocks = [i for i, f in enumerate(flags_list) if f]
    bad = int(summed[n + blocks[0]])
    ignored = f" (ignore_index={ignore_index} is skipped)" if ignore_index is not None else ""
    raise ShapeError(f"{what}: id {bad} is outside the vocabulary [0, {vocab_size}){ignored} (in {block} "
                     f"{blocks[0]}; {block}s with bad ids: {blocks} of {n}): every id must be a row of the table. Fix: check the "
                     f"tokenizer / vocab_size, and mark padding targets with ignore_index.")
