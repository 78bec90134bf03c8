"""The runtime half of the scheme protocol, with the defaults of a mode whose weights stay whole.

:class:`gridshard.tensor_scheme.TensorScheme` (a leaf, no torch) answers the layout questions;
:class:`Scheme` adds what needs layers and tensors: the loss of a language model's logits and of a
classifier's, and a classifier's correct count. Every built-in mode subclasses it, and so does a mode
a user registers (``tests/test_tensor_scheme.py``). Defaults: a rank's logits cover the whole
vocabulary for its own rows; the rows of a tensor group's micro-batch are cut into
``mesh.batch_blocks`` blocks summed over :meth:`batch_block_axis` (None: one block).
"""
from __future__ import annotations

import torch.nn.functional as F

from ..nn.classification_loss import classification_loss, correct_count
from ..tensor_scheme import TensorScheme
from ..theory.memory import FP32, INDEX_BYTES, MASK_BYTES, RankShape


class Scheme(TensorScheme):
    """A tensor scheme with the runtime defaults (module docstring)."""

    def batch_block_axis(self, mesh):
        """The axis over which the tensor group's batch blocks are summed (None: the group holds one block)."""
        return None

    def batch_blocks_name(self, mesh) -> str:
        """What a message calls the blocks a micro-batch's rows are cut into (``mesh.batch_blocks``)."""
        return "batch blocks"

    def lm_loss(self, logits, targets, ctx, ignore_index: int, reduction: str):
        """Cross-entropy of this rank's logits over the tensor group's targets, the same scalar on every
        tensor rank (:meth:`gridshard.parallel.ParallelContext.loss`). Default: whole-vocabulary logits of
        the rank's rows, summed over the batch blocks when there are several."""
        axis = self.batch_block_axis(ctx.mesh)
        if axis is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                   ignore_index=ignore_index, reduction=reduction)
        flat = logits.reshape(-1, logits.shape[-1])
        return classification_loss(flat, targets.reshape(-1), axis, ignore_index, reduction)

    def classification_loss(self, logits, labels, mesh, ignore_index: int, reduction: str):
        """A classifier's loss over the tensor group's labels (:mod:`gridshard.nn.classification_loss`)."""
        return classification_loss(logits, labels, self.batch_block_axis(mesh), ignore_index, reduction)

    def correct_count(self, logits, labels, mesh):
        """How many of the tensor group's inputs the classifier gets right, the same on every tensor rank."""
        return correct_count(logits, labels, self.batch_block_axis(mesh))

    # ---- per-rank shapes and memory terms (gridshard/theory/memory/activations.py §2) -------------------------
    def rank_shape(self, cfg, T: int, sequence_parallel: bool, tokens: int) -> RankShape:
        """One rank's rows N_r, residual elements R, heads H_r, kv heads K_r, neurons f_r and logits
        columns V_r of a micro-batch of ``tokens`` tokens. Default: everything whole."""
        h = cfg.hidden
        return RankShape(tokens, tokens * h, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.vocab_size)

    def norm_saved_bytes(self, cfg, T: int, r: RankShape, e: int, consumer_input: int) -> int:
        """One RMSNorm's saved tensors and its consumer's input: x, x̂ (fp32 only: ``F.rms_norm``
        decomposed), the fp32 rstd per row, and y (``consumer_input``, 0 when rebuilt)."""
        x_hat = r.residual * e if e == FP32 else 0       # bf16/fp16: rebuilt in backward (nn.norm.rms_norm)
        return r.residual * e + x_hat + (r.residual // cfg.hidden) * FP32 + consumer_input

    def autocast_weight_elements(self, cfg, T: int) -> tuple:
        """(per decoder layer, head) weight elements autocast copies to the compute dtype and autograd
        keeps: every weight multiplied through ``F.linear`` (default: all of them, h_in = h)."""
        return self._grid_weight_elements(cfg, T, cfg.hidden)

    def _grid_weight_elements(self, cfg, T: int, h_in: int) -> tuple:
        r = self.rank_shape(cfg, T, False, 0)
        d = cfg.head_dim
        return h_in * (d * (2 * r.heads + 2 * r.kv_heads) + cfg.mlp_matrices * r.ffn), h_in * r.vocab_block

    def embedding_saved_bytes(self, T: int, tokens: int) -> int:
        """Token ids (N·8), plus the out-of-range mask (N·1) of a table split over T > 1 ranks."""
        return tokens * INDEX_BYTES + (tokens * MASK_BYTES if T > 1 else 0)

    def head_and_loss_saved_bytes(self, cfg, T: int, r: RankShape, e: int) -> int:
        """The fp32 (log-)softmax over this rank's logits block, the targets, and the loss's scalar."""
        n = r.token_rows
        return n * r.vocab_block * FP32 + n * INDEX_BYTES + FP32

    @staticmethod
    def masked_loss_bytes(r: RankShape) -> int:
        """fp32 logits block, targets and two boolean masks (the vocabulary-parallel losses)."""
        n = r.token_rows
        return n * r.vocab_block * FP32 + n * INDEX_BYTES + 2 * n * MASK_BYTES

    @staticmethod
    def grid_norm_saved_bytes(cfg, r: RankShape, q: int, e: int, consumer_input: int) -> int:
        """2D's norm function (3D: on the cube's output axis): x, y, the fp32 rstd per row and the
        gathered fp32 weight block h/q."""
        return r.residual * e + consumer_input + r.token_rows * FP32 + (cfg.hidden // q) * FP32

    # ---- a Vision Transformer's terms (gridshard/theory/memory/vision.py) --------------------------------------
    def layer_norm_saved_bytes(self, cfg, T: int, r: RankShape, e: int, pb: int, output_kept: bool) -> int:
        """One LayerNorm (``F.layer_norm``): its input x (R·e), the mean and rstd per row (in the
        parameters' dtype, pb bytes: measured on CPU, where a bf16 input with bf16 weights gives bf16
        statistics) and, when ``output_kept``, the output y its consumer keeps (R·e)."""
        rows = r.residual // cfg.hidden
        return r.residual * e + 2 * rows * pb + (r.residual * e if output_kept else 0)

    def image_embedding_saved_bytes(self, cfg, T: int, batch: int, e: int, pb: int) -> int:
        """The patch convolution keeps the images (in the compute dtype: b·C·H²·e) and, under autocast
        over wider parameters (e < pb), its e-byte kernel copy h·C·P²·e."""
        kernel = cfg.hidden * cfg.channels * cfg.patch_size ** 2
        return batch * cfg.channels * cfg.image_size ** 2 * e + (kernel * e if e < pb else 0)

    def class_head_saved_bytes(self, cfg, T: int, r: RankShape, batch: int, e: int, pb: int,
                               sequence_parallel: bool = False) -> int:
        """The class-token classifier keeps the final norm's output through the class row, a view of
        it (R·e), and under autocast over wider parameters its e-byte weight copy h·K·e; then the
        classification loss (:meth:`class_loss_bytes`). ``sequence_parallel``: in effect
        (:meth:`sequence_parallel_in_effect`); only 1D's classifier keeps something else under it."""
        copy = cfg.hidden * cfg.num_classes * e if e < pb else 0
        return r.residual * e + copy + self.class_loss_bytes(cfg, r, batch)

    @staticmethod
    def class_loss_bytes(cfg, r: RankShape, batch: int) -> int:
        """The fp32 log-softmax of the rank's b_r = N_r/s rows of logits (b_r·K·4), the labels (a
        view of the whole micro-batch's, b·8) and the 4-byte total."""
        return r.token_rows // cfg.seq_len * cfg.num_classes * FP32 + batch * INDEX_BYTES + FP32

    @staticmethod
    def grid_layer_norm_saved_bytes(cfg, r: RankShape, q: int, e: int, pb: int, output_bytes: int) -> int:
        """2D's LayerNorm function (3D: on the cube's output axis): x̂ (R·e), the fp32 rstd per row
        (N_r·4), the gathered weight block (h/q·pb) and ``output_bytes``, what its consumer keeps of y."""
        return r.residual * e + r.token_rows * FP32 + cfg.hidden // q * pb + output_bytes

    @staticmethod
    def grid_image_embedding_saved_bytes(cfg, batch: int, blocks: int, q: int, e: int) -> int:
        """The grid's patch embedding: the rank's batch block of images (under autocast its e-byte
        copy, b/``blocks`` rows; in fp32 a view of the whole micro-batch, b rows) and the e-byte copy
        of its h/q kernel rows (h/q·C·P²·e, in any precision)."""
        rows = batch if e == FP32 else batch // blocks
        image = cfg.channels * cfg.image_size ** 2
        return rows * image * e + cfg.hidden // q * cfg.channels * cfg.patch_size ** 2 * e

    def grid_class_head_saved_bytes(self, cfg, r: RankShape, batch: int, q: int, e: int, pb: int) -> int:
        """The grid's classifier: the class rows of the final norm's output (a view of it, R·e, when
        the norm's output is already e-byte; else their e-byte copy b_r·h/q·e), the e-byte copy of its
        h/q weight rows (h/q·K·e, in any precision) and the loss."""
        row = r.residual * e if pb <= e else r.token_rows // cfg.seq_len * (cfg.hidden // q) * e
        return row + cfg.hidden // q * cfg.num_classes * e + self.class_loss_bytes(cfg, r, batch)
