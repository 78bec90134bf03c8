#!/usr/bin/env python3
"""A small, curated mutation check of gridshard's core: does some test catch each bug?

Each mutant below is one plausible semantic bug (a wrong dual backward, a SUMMA panel
from the wrong source, a loss without its max shift, ...), written as exact edits of the
current source and the tests that must catch it. For every mutant the script

1. copies a snapshot of the repository into a scratch directory (by default the working
   tree as it is now, uncommitted changes and untracked files included; never the
   repository itself: nothing here writes to your checkout),
2. applies the edits — each original snippet must occur EXACTLY once, otherwise the row
   says ``snippet?`` and the run fails: the code moved, the mutant must be updated,
3. runs only the named tests there (``python -m pytest -x -q -p no:cacheprovider``, this
   interpreter, the copy first on ``PYTHONPATH``),
4. records ``killed`` (pytest exit 1: a test failed), ``SURVIVED`` (exit 0), or
   ``error`` (any other exit: a named test does not exist, collection failed, timeout),

then prints a table. Exit status 0 only if every mutant was killed.

Usage::

    python scripts/mutants.py               # all mutants (make mutants)
    python scripts/mutants.py --list        # ids, files and killing tests
    python scripts/mutants.py --only loss1d-max-shift --only loss2d-max-shift
    python scripts/mutants.py --baseline    # also run each mutant's tests unmutated first
    python scripts/mutants.py --rev HEAD    # tracked files from a commit (+ untracked files)

``--baseline`` proves that a kill means something (the tests pass without the mutant);
it doubles the time. ``--rev`` is for a working tree that is mid-edit: tracked files come
from the given commit, untracked (not ignored) files such as new tests from the tree.

Not part of the default test suite (it runs the suite's tests many times over).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str                    # path relative to the repository root
    edits: tuple                 # ((original snippet, replacement), ...); each original exactly once
    tests: tuple                 # pytest arguments: node ids, or "-k", "expr" pairs after a path
    why: str = ""                # the bug it stands for
    notes: tuple = field(default_factory=tuple)


MUTANTS = [
    Mutant("vit-cls-token-sp", "gridshard/tensor/tp1d/classifier.py",
           (("        return gather_from_group(x[:, :1].contiguous(), self.axis, 1)[:, 0]\n",
             "        return x[:, 0]\n"),),
           ("tests/test_vit.py::test_vit_layout_matches_one_process[layout2]", "-m", "wide"),
           "under sequence parallelism every rank classifies its own block's first token, not the class token"),
    Mutant("vit-2d-loss-one-block", "gridshard/tensor/tp2d/scheme.py",
           (("        return mesh.col\n", "        return None\n"),),
           ("tests/test_vit_train.py::test_vit_2d_training_matches_one_process",),
           "the 2D classification loss counts only the grid row's batch block, not the sum over the column"),
    Mutant("vit-layernorm-sp-partial", "gridshard/nn/norm.py",
           (("            vectors = tuple(copy_to_group(v, self.axis) for v in vectors)\n", "            pass\n"),),
           ("tests/test_vit.py::test_vit_layout_matches_one_process[layout2]", "-m", "wide"),
           "LayerNorm under sequence parallelism keeps its block's partial weight/bias gradients (not summed)"),
    Mutant("dual-copy-backward", "gridshard/comm/dual_ops.py",
           (("        return C.all_reduce(g, ctx.axis), None\n", "        return g, None\n"),),
           ("tests/test_comm.py::test_dual_functions_backward_is_adjoint[2]",),
           "copy_to_group's backward forgets the all-reduce (column-parallel input grads stay partial)"),
    Mutant("dual-reduce-backward", "gridshard/comm/dual_ops.py",
           (("    def forward(ctx, x, axis):\n        return C.all_reduce(x, axis)\n\n"
             "    @staticmethod\n    def backward(ctx, g):\n        return g, None\n",
             "    def forward(ctx, x, axis):\n        ctx.axis = axis\n        return C.all_reduce(x, axis)\n\n"
             "    @staticmethod\n    def backward(ctx, g):\n        return C.all_reduce(g, ctx.axis), None\n"),),
           ("tests/test_comm.py::test_dual_functions_backward_is_adjoint[2]",),
           "reduce_from_group's backward all-reduces too (row-parallel grads counted T times)"),
    Mutant("dual-gather-seq-backward", "gridshard/comm/dual_ops.py",
           (('_GatherSequence = _dual("_GatherSequence", "all_gather", "reduce_scatter")\n',
             '_GatherSequence = _dual("_GatherSequence", "all_gather", "split")\n'),),
           ("tests/test_comm.py::test_dual_functions_backward_is_adjoint[2]",),
           "gather_sequence's backward takes my slice instead of reduce-scattering partial grads (SP)"),
    Mutant("summa-ab-panel-source", "gridshard/tensor/tp2d/summa.py",
           (("_panel(b, col, t + 1, overlap)) if t + 1 < q else None",
             "_panel(b, col, t, overlap)) if t + 1 < q else None"),),
           ("tests/test_summa.py::test_summa_products_q2[False]",),
           "A·B prefetches B's panel from the wrong source row (C(i,j) += A(i,t)·B(t-1,j))"),
    Mutant("summa-ab-backward-axes", "gridshard/tensor/tp2d/summa.py",
           (("        reduce_b = C.reduce_scatter(terms_b, col, 0, async_op=True)\n",
             "        reduce_b = C.reduce_scatter(terms_b, row, 0, async_op=True)\n"),),
           ("tests/test_summa.py::test_summa_products_q2[True]",),
           "the weight gradient of A·B (Aᵀ·g) reduces its terms along the grid row instead of the column"),
    Mutant("loss1d-max-shift", "gridshard/tensor/tp1d/cross_entropy.py",
           (("        shifted = z - gmax.unsqueeze(-1)\n", "        shifted = z\n"),),
           ("tests/test_loss_stability.py", "-k", "1d"),
           "1D vocab-parallel loss without the max subtraction: exact algebra, inf for logits ≳ 89"),
    Mutant("loss2d-max-shift", "gridshard/tensor/tp2d/cross_entropy.py",
           (("        e = torch.exp(z - m.unsqueeze(-1))\n", "        e = torch.exp(z)\n"),
            ("        tok = (torch.log(s_zt[0]) + m - s_zt[1])", "        tok = (torch.log(s_zt[0]) - s_zt[1])")),
           ("tests/test_loss_stability.py", "-k", "2d"),
           "2D loss without the max subtraction (forward and softmax): inf/NaN for large logits"),
    Mutant("sp-norm-weight-grad", "gridshard/nn/norm.py",
           (("            vectors = tuple(copy_to_group(v, self.axis) for v in vectors)\n", "            pass\n"),),
           ("tests/test_tp1d_layers.py::test_layers_match_reference[2-tp+sp]",),
           "the SP RMSNorm weight gradient is left partial (one sequence block's sum per rank)"),
    Mutant("dp-average-divisor", "gridshard/zero/reduction.py",
           (("                u.reduced.div_(self.axis.size)", "                pass"),),
           ("tests/test_train_equivalence.py::test_layout_gives_the_same_run[D2-T1-none]",),
           "data-parallel gradients summed instead of averaged (D× too large)"),
    Mutant("grad-buffer-views-alias", "gridshard/zero/flat_layout.py",
           (("return [buffer[o:o + n].view(shape) for o, n, shape in zip(self.offsets, self.numels, shapes)]",
             "return [buffer[:n].view(shape) for o, n, shape in zip(self.offsets, self.numels, shapes)]"),),
           ("tests/test_grad_buffer.py",),
           "every gradient view aliases the start of the persistent buffer (gradients summed into each other)"),
    Mutant("grad-buffer-bucket-slice", "gridshard/zero/reduction.py",
           (("        return C.all_reduce(u.send, self.axis, async_op=True, inplace=True)\n",
             "        return C.all_reduce(u.send[u.layout.offsets[-1]:], self.axis, async_op=True, inplace=True)\n"),),
           ("tests/test_train_equivalence.py::test_layout_gives_the_same_run[D2-T1-none]",),
           "a bucket's all-reduce covers only its last parameter's slice (the others stay local)"),
    Mutant("grad-buffer-not-zeroed", "gridshard/zero/reduction.py",
           (("            elif u.grads_live:\n                u.grad_buffer.zero_()\n",
             "            elif u.grads_live:\n                pass\n"),),
           ("tests/test_grad_buffer.py",),
           "the persistent gradient buffer is not zeroed between steps (gradients accumulate over steps)",
           ("the one-process reference zeroes through the same buffer, so the equivalence tests cannot see it",)),
    Mutant("dp-arm-first-micro-batch", "gridshard/engine/step.py",
           (("if a == len(micro) - 1:", "if a == 0:"),),
           ("tests/test_train_equivalence.py::test_layout_gives_the_same_run[D2-T2-1d-SP-acc2]",),
           "the overlapped DP reduction is armed at the first micro-batch: later ones are lost",
           ("needs a D=2, 2-micro-batch layout ('D2-T2-1d-SP-acc2') in tests/test_train_equivalence.py",)),
    Mutant("kv-replica-grad-unsummed", "gridshard/comm/dual_ops.py",
           (("return C.all_reduce(buf, axis, inplace=True)[axis.rank // r], None, None", "return g, None, None"),),
           ("tests/test_parallelize.py::test_parallelized_model_equals_plain_model[T4-1d-kv-replicated]",),
           "a kv block shared by T/kv ranks keeps one rank's partial gradient instead of the group's sum"),
    Mutant("init-ignores-transposed-storage", "gridshard/parallel/materialize.py",
           (("    if spec.transposed:\n        dims, view = dims[::-1], local.t()", "    if False:\n        pass"),),
           ("tests/test_parallelize.py::test_parallelized_model_equals_plain_model[T4-2d-gqa]",),
           "counter-RNG values of a Linear2D block drawn at [in, out] indices: a different global model in 2D"),
    Mutant("shared-input-skips-prepare", "gridshard/tensor/tp1d/fused_input.py",
           (("    return copy_to_group(x, first.axis)", "    return x"),),
           ("tests/test_parallelize.py::test_parallelized_model_equals_plain_model[T2-1d-no-overlap]",),
           "the fused q|k|v / gate|up input is not all-reduced in backward (input gradient partial)",
           ("re-targeted: with parallel.overlap_input_grad on (the default) the column product carries the "
            "input gradient's all-reduce itself, so only the no-overlap case runs copy_to_group",)),
    Mutant("clip-count-origin-only", "gridshard/engine/clip.py",
           (("return all(index[c] == 0 for c in basis - split)", "return all(index[c] == 0 for c in basis)"),),
           ("tests/test_train_engine.py::test_norm_ownership_counts_each_parameter_once",),
           "the global grad norm counts only the grid origin's blocks (split shards are missed)"),
    Mutant("rope-cache-key-without-length", "gridshard/models/rope.py",
           (("key = (seq_len, head_dim, float(theta), device, tuple(context), dtype)",
             "key = (head_dim, float(theta), device, tuple(context), dtype)"),),
           ("tests/test_slow_paths.py::test_rope_tables_built_once_per_length_equal_and_not_saved",),
           "the RoPE table cache ignores the sequence length (a longer sequence reads a too-short table)"),
    Mutant("offload-grad-staging-pageable", "gridshard/zero/offload.py",
           (("h.grad = self.grad_staging[p] = self._host_buffer(p.shape)",
             "h.grad = self.grad_staging[p] = torch.zeros_like(h)"),),
           ("tests/test_slow_paths.py::test_offload_pins_host_buffers_and_waits_on_one_event_per_step",),
           "offload stages gradients in pageable memory (zeros_like of a pinned tensor is not pinned)"),
    Mutant("loss1d-mean-divides-by-zero", "gridshard/nn/classification_loss.py",
           (("mean = total / count.clamp(min=1).to(total.dtype)", "mean = total / count.to(total.dtype)"),),
           ("tests/test_masked_loss.py::test_masked_targets_give_the_plain_models_loss_and_gradients[T2-1d]",),
           "1D mean over zero valid targets: its backward multiplies inf by 0, every gradient NaN"),
    Mutant("loss2d-mean-divides-by-zero", "gridshard/tensor/tp2d/cross_entropy.py",
           (("1.0 / count.clamp(min=1.0)", "1.0 / count"),),
           ("tests/test_masked_loss.py::test_masked_targets_give_the_plain_models_loss_and_gradients[T4-2d]",),
           "2D mean backward divides by a zero valid count: every gradient NaN"),
    Mutant("bad-target-raised-locally", "gridshard/tensor/tp2d/cross_entropy.py",
           (("    # the id range is checked inside the forward, agreed over the column (module docstring)\n",
             "    from .embedding_1d import check_token_range\n"
             "    check_token_range(targets, vocab_size, 'cross_entropy_2d targets', ignore_index)\n"),),
           ("tests/test_bad_ids_2d.py::test_bad_id_in_one_batch_block_raises_on_every_rank[q2]",),
           "a bad target raised by the grid rows that hold it only: the other rows wait in the column all-reduce"),
    Mutant("bad-token-raised-locally", "gridshard/tensor/grid_embedding.py",
           (('check_blocks(all_tokens, self.vocab, f"{type(self).__name__} tokens", gather.size)',
             'check_blocks(tokens, self.vocab, f"{type(self).__name__} tokens", 1)'),),
           ("tests/test_bad_ids_2d.py::test_bad_id_in_one_batch_block_raises_on_every_rank[q2]",),
           "a bad token id checked on the rank's own batch block: only its grid row raises, the others "
           "wait in the reduce-scatter"),
    Mutant("masked-local-normaliser", "gridshard/engine/step.py",
           (("weight = job.mesh.data_context.size / n_valid if n_valid else 0.0",
             "weight = 1.0 / max(1, sum(int((y != job.ignore_index).sum()) for _, y in batch.micro))"),),
           ("tests/test_masked_training.py::test_masked_run_is_the_same_at_every_layout[D4-none-m4]",),
           "masked training normalised by each data rank's own valid targets instead of the global batch's"),
    Mutant("token-range-off-by-one", "gridshard/tensor/tp1d/embedding.py",
           (("int(live.max()) >= vocab_size):", "int(live.max()) > vocab_size):"),),
           ("tests/test_loss_stability.py::test_targets_at_the_vocabulary_edges",),
           "token id == vocab_size passes the range check (silent zero embedding / wrong loss)"),
    Mutant("ckpt-load-at-offset-zero", "gridshard/checkpoint/blocks.py",
           (("items += create_read_items_for_chunk_list(b.fqn, md, [b.chunk()])",
             "items += create_read_items_for_chunk_list(b.fqn, md, [ChunkStorageMetadata(\n"
             "                offsets=torch.Size([0] * len(b.offsets)), sizes=torch.Size(b.sizes))])"),),
           ("tests/test_checkpoint.py::test_reshard_matrix_tied_gqa[D1-T4-2d]",),
           "every rank reads the first block of each tensor on load (DCP's plain-tensor behaviour)"),
    Mutant("ckpt-latest-before-complete", "gridshard/checkpoint/checkpointer.py",
           (("        hit(self.faults, \"save_after_metadata\", self.rank, step)\n",
             "        F.update_latest(self.root, F.step_dir_name(step))\n"
             "        hit(self.faults, \"save_after_metadata\", self.rank, step)\n"),),
           ("tests/test_checkpoint.py::test_a_save_killed_at_any_point_leaves_latest_complete[save_after_metadata]",),
           "'latest' is pointed at a checkpoint before its folder is complete and published"),
    Mutant("ckpt-second-moment-not-saved", "gridshard/checkpoint/blocks.py",
           (('ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")', 'ADAM_MOMENTS = ("exp_avg",)'),),
           ("tests/test_checkpoint.py::test_resume_is_bit_exact_at_the_same_layout[D1-T4-1d]",),
           "AdamW's second moment is left out of the checkpoint (resume silently resets it)"),
    # ---- trust (issue 21): bytes from disk are data, a diverged run keeps its good checkpoints ----
    Mutant("ckpt-nontensor-entry-admitted", "gridshard/checkpoint/dcp_metadata.py",
           (("        if not isinstance(md, TensorStorageMetadata):\n            raise Refused(",
             "        if False:\n            raise Refused("),),
           ("tests/test_checkpoint_trust.py::test_each_layer_alone_refuses_a_bytes_entry",),
           "a .metadata entry that is not a tensor (DCP torch.loads it with weights_only=False) is admitted"),
    Mutant("ckpt-latest-any-name", "gridshard/checkpoint/folders.py",
           (("(name and not _STEP_DIR.match(name))", "False"),),
           ("tests/test_checkpoint_trust.py::test_every_in_process_reader_refuses[latest_dotdot]",),
           "`latest` may name any path (../.., an absolute path): readers leave the run directory"),
    Mutant("ckpt-meta-not-checked-against-tensors", "gridshard/checkpoint/reader.py",
           (("    _check_meta_against_tensors(meta, metadata)       # 5\n", "    pass\n"),),
           ("tests/test_checkpoint_trust.py::test_every_in_process_reader_refuses[meta_vocab]",),
           "meta.json describing another model than its tensors is exported / loaded as is"),
    Mutant("ckpt-nonfinite-published", "gridshard/checkpoint/checkpointer.py",
           (("        if bad:\n", "        if False:\n"),),
           ("tests/test_divergence_and_disk.py::test_a_checkpoint_with_nan_weights_is_never_published",),
           "a checkpoint whose weights hold NaN/inf is published and made `latest`"),
    # ---- the composer and the step (issue 22, step 4) ----
    Mutant("compose-compile-before-recompute", "gridshard/engine/job.py",
           (("    _recompute(job)\n    _compile(job)\n", "    _compile(job)\n    _recompute(job)\n"),),
           ("tests/test_compose.py::test_train_step_loop_is_trainer_run_bit_for_bit[P2-pipelined]",),
           "build_job composes out of its documented order (compile before recompute)"),
    Mutant("resolved-config-resolved-again", "gridshard/engine/job.py",
           (("        return config.config\n",
             "        return resolve_config(config.config, overrides, world_size=config.world_size)\n"),),
           ("tests/test_compose.py::test_a_resolved_config_is_not_resolved_again",),
           "a worker loads and validates the launcher's resolved config again (re-reading the data files)"),
    Mutant("nonfinite-norm-ignored", "gridshard/engine/trainer.py",
           (("        if math.isfinite(value):\n", "        if True:\n"),),
           ("tests/test_divergence_and_disk.py::test_skip_drops_the_update_of_a_nonfinite_step",),
           "a non-finite gradient norm is stepped with (train.on_nonfinite ignored): NaN weights"),
    Mutant("pipeline-tied-grad-not-summed", "gridshard/pipeline/tied.py",
           (("            C.all_reduce(self.param.grad, self.axis, inplace=True)", "            pass"),),
           ("tests/test_pipeline.py::test_pipeline_run_equals_one_device[D1-P2-T2-1d-tied]",),
           "the tied embedding's copies on the first and last stage keep only their own gradient"),
    Mutant("hf-stage-no-rope", "gridshard/models/hf_stages.py",
           (('"position_embeddings": self.model.rotary_emb(x, position_ids=position_ids)}',
             '"position_embeddings": self.model.rotary_emb(x, position_ids=position_ids * 0)}'),),
           ("tests/test_hf_pipeline.py::test_pipelined_hf_llama_equals_one_process[D1-P2-T2-1d-SP-tied]",),
           "a Hugging Face model's pipeline stages rotate every position as position 0 (no RoPE)"),
    Mutant("pipeline-norm-one-stage", "gridshard/engine/clip.py",
           (("        total = C.all_reduce(total, pipeline_axis, inplace=True)", "        pass"),),
           ("tests/test_pipeline.py::test_pipeline_run_equals_one_device[D1-P2-none-1f1b]",),
           "the gradient norm for clipping counts only this stage's parameters"),
    Mutant("zero-sum-not-mean", "gridshard/zero/reduction.py",
           (("                u.reduced.div_(self.axis.size)", "                pass"),),
           ("tests/test_zero.py::test_zero_stages_equal_zero0_memory_and_traffic_match_theory[D4-none-odd-tied]",),
           "ZeRO's reduce-scatter sums the data ranks' gradients instead of averaging them (D× too large)"),
    Mutant("zero-norm-one-data-rank", "gridshard/engine/clip.py",
           (("        total = C.all_reduce(total, data_axis, inplace=True)\n", "        pass\n"),),
           ("tests/test_zero.py::test_zero_stages_equal_zero0_memory_and_traffic_match_theory[D4-none-odd-tied]",),
           "under ZeRO the gradient norm counts only this data rank's elements (clipping too weak, ranks disagree)"),
    Mutant("zero3-regather-skipped", "gridshard/zero/gather.py",
           (("        ctx.zero.gather(ctx.unit, ahead=-1)\n", "        pass\n"),),
           ("tests/test_zero.py::test_zero_stages_equal_zero0_memory_and_traffic_match_theory[D4-none-odd-tied]",),
           "ZeRO-3 does not gather a layer's parameters again for its backward (freed storage used)"),
    Mutant("zero3-pages-receive-slot-leaked", "gridshard/zero/reduction.py",
           (("        self._give_slot(u.recv_slot)\n", "        pass\n"),),
           ("tests/test_zero3_pages.py::test_pages_equal_heap_bit_for_bit_at_d2_with_a_resident_staging_pool",),
           "ZeRO-3 host pages never return a reduce-scatter's staging slot: after MAX_IN_FLIGHT + 1 "
           "reductions every one allocates its receive buffer in glibc's heap again (values unchanged)"),
    Mutant("zero3-pages-backward-not-trimmed", "gridshard/zero/gather.py",
           (("        ctx.zero.trim_before_regather()\n", ""),),
           ("tests/test_zero3_pages.py::test_pages_equal_heap_bit_for_bit_at_d2_with_a_resident_staging_pool",),
           "ZeRO-3 host pages never trim the heap in the backward: the activations it frees stay resident "
           "under its gradient buffers and gathers (0.81 of the predicted saving, values unchanged)"),
    Mutant("zero-rows-box-not-narrowed", "gridshard/nn/sharding.py",
           (("dims = [ix[lo:hi] for ix, (lo, hi) in zip(dims, local_box)]",
             "dims = [ix[:hi - lo] for ix, (lo, hi) in zip(dims, local_box)]"),),
           ("tests/test_zero.py::test_checkpoints_reshard_between_zero3_d4_and_zero0_d2_t2",),
           "a ZeRO element range's checkpoint boxes start at its block's first row and column, not at its own"),
    Mutant("memory-blocks-tied-head-twice", "gridshard/parallel/rank_blocks.py",
           (("                       if not (has_embedding and tied_to is not None)]\n", "                       ]\n"),),
           ("tests/test_memory_model.py::test_parameter_blocks_are_the_laid_out_shapes[T2-1d-SP-tied]",),
           "the memory model counts a tied head a second time on a rank that holds the embedding"),
    Mutant("vectors-kept-across-steps", "gridshard/comm/grid_ops.py",
           (("            raise RuntimeError(\"GatheredVectors.window() is already open; windows do not nest. Fix: \"\n"
             "                               \"open one window per optimizer step, around its forwards and backwards.\")\n"
             "        self._kept = {}\n",
             "            pass\n        self._kept = self._kept if self._kept is not None else {}\n"),
            ("        finally:\n            self._kept = None\n", "        finally:\n            pass\n")),
           ("tests/test_tp2d_layers.py::test_vector_cache_q2",
            "tests/test_train_equivalence.py::test_layout_gives_the_same_run[D1-T4-2d]"),
           "gathered 2D biases / norm weights survive the optimizer step (stale values in the next forward)"),
    Mutant("input-grad-early-result-always", "gridshard/tensor/tp1d/input_grad_overlap.py",
           (("        return result if same else None\n", "        return result\n"),),
           ("tests/test_tp1d_layers.py::test_layers_match_reference[2-tp]",),
           "the column entry takes the early-reduced gradient even when its input had another consumer"),
    Mutant("input-grad-launch-unconditional", "gridshard/tensor/tp1d/linear.py",
           (("            if ctx.entry is not None and torch._C._will_engine_execute_node(ctx.entry):\n",
             "            if ctx.entry is not None:\n"),),
           ("tests/test_tp1d_layers.py::test_layers_match_reference[2-tp+sp]",),
           "a backward that wants only weight gradients still launches the input-gradient collective"),
    Mutant("sp-column-saves-gathered-input", "gridshard/tensor/tp1d/linear.py",
           (("    return block if block.shape[d] * handoff.axis.size == x.shape[d] else None\n",
             "    return None\n"),),
           ("tests/test_tp1d_layers.py::test_layers_match_reference[2-tp+sp]",),
           "an SP column layer keeps the all-gathered input for backward instead of its sequence block (T× the bytes)"),
    Mutant("planner-bubble-in-throughput", "gridshard/planner/cost_time.py",
           (("                    data_comm_s=data.busy_s, bubble_s=0.0, optimizer_s=x[\"busy_opt\"],\n",
             "                    data_comm_s=data.busy_s, bubble_s=bubble_s, optimizer_s=x[\"busy_opt\"],\n"),),
           ("tests/test_planner.py::test_oversubscribed_node_is_throughput_bound",),
           "an over-subscribed node charges the pipeline bubble although the idle stages' cores run the others"),
    Mutant("planner-calls-cpu-as-wall", "gridshard/planner/price_tensor.py",
           (("sum(comm_cpu_seconds(vols, hw, levels.get(a, pr.levels[\"tensor\"])) for a, vols in per_axis.items())",
             "sum(comm_seconds(vols, hw, levels.get(a, pr.levels[\"tensor\"]), pr.skew) for a, vols in per_axis.items())"),),
           ("tests/test_planner.py::test_collective_cpu_seconds_and_tensor_call_overhead",),
           "a tensor collective's busy time is its wall time, not the CPU seconds it keeps a core busy"),
    Mutant("planner-sends-always-fp32", "gridshard/planner/price_pipeline.py",
           (("                         cfg.hidden, dtype=precision)\n", "                         cfg.hidden)\n"),),
           ("tests/test_planner.py::test_pipeline_sends_priced_in_the_compute_dtype",),
           "stage-to-stage sends priced in fp32 whatever the run's precision (twice the bytes of a bf16 run)"),
    Mutant("pipeline-stage-outputs-not-kept", "gridshard/theory/pipeline.py",
           (("(0 if last else (A + in_flight) * per_boundary)", "(0 if last else A * per_boundary)"),),
           ("tests/test_memory_model.py::test_pipeline_stage_buffers_by_hand",),
           "the memory model forgets the stage outputs torch's PipelineStage keeps until each micro-batch's backward"),
    Mutant("pipeline-reduction-cast-on-top-of-activations", "gridshard/theory/memory/predict.py",
           (("    late = zero_reduce_cast_bytes(blocks, zero, data, pb, rb) if P > 1 and not overlap else 0\n",
             "    late = 0\n"),),
           ("tests/test_memory_model.py::test_pipeline_reduction_cast_counts_after_the_backward",),
           "a pipeline's ZeRO reduction cast is added to the activations although it runs after they are freed"),
    Mutant("planner-2p5d-rows-not-split", "gridshard/planner/layouts.py",
           (("micro_batch=self.micro_batch // d,\n", "micro_batch=self.micro_batch,\n"),),
           ("tests/test_planner_2p5d.py",),
           "a 2.5D layout is priced with the whole micro-batch on every depth layer instead of its m/d rows"),
    Mutant("planner-2p5d-summa-link-spans-depth", "gridshard/planner/price_links.py",
           (('    levels = {"tensor": inside(layout.layer_tensor),', '    levels = {"tensor": inside(layout.tensor),'),),
           ("tests/test_planner_2p5d.py::test_explain_says_why_2p5d_wins_against_2d_at_the_same_t",),
           "2.5D's SUMMA traffic is priced on the link of the whole T = q²·d group, not one depth layer's q² ranks"),
    Mutant("planner-one-node-by-default", "gridshard/planner/search.py",
           (("    need = -(-world // per)\n", "    need = 1\n"),),
           ("tests/test_planner.py::test_nodes_default_to_the_hardware_node_size",),
           "without --nodes every device is planned in one node (NVLink prices, over-subscribed compute)"),
    Mutant("planner-never-lightens-the-head-stage", "gridshard/planner/search.py",
           (("    off_last = P - 1 in slow and head_outweighs_a_layer\n", "    off_last = False\n"),),
           ("tests/test_planner.py::test_planner_moves_a_layer_off_a_slow_end_stage",),
           "the planner only prices the even split, however much the head slows the last stage"),
    Mutant("split-leftovers-to-the-first-stages", "gridshard/job_layout.py",
           (("    for s in (list(range(1, stages - 1)) + [0])[:extra]:", "    for s in range(extra):"),),
           ("tests/test_pipeline.py::test_default_split_is_even_and_gives_leftovers_to_the_middle",),
           "the layers left over by L/S go to the first stages, which already carry the embedding"),
    Mutant("ledger-pause-one-ledger-only", "gridshard/comm/ledger.py",
           (("        return self.enabled and not _PAUSED.get()\n", "        return self.enabled\n"),),
           ("tests/test_ledger_route.py::test_gathered_state_dict_stays_out_of_the_jobs_ledger",),
           "a pause stops only the current ledger: gathering a state dict on a job's mesh lands in the job's ledger"),
    Mutant("ledger-route-ignores-mesh", "gridshard/comm/ledger.py",
           (("    return bound if bound is not None else _CURRENT.get()\n", "    return _CURRENT.get()\n"),),
           ("tests/test_ledger_scope.py::test_meshes_record_into_their_own_ledgers",),
           "collectives on a job's mesh are written to the current ledger: two jobs in one process mix their counts"),
    Mutant("job-sp-in-effect-at-one-rank", "gridshard/tensor/tp1d/scheme.py",
           (("        return bool(requested) and T > 1\n",
             "        return bool(requested)\n"),),
           ("tests/test_tp1d_layers.py::test_layers_match_reference[1-tp+sp]",),
           "sequence parallelism counted as in effect on one tensor rank (a partial-gradient norm weight at T=1)"),
    Mutant("job-kv-heads-never-replicated", "gridshard/tensor/tp1d/scheme.py",
           (("        return T // kv_heads if T > kv_heads else 1\n", "        return 1\n"),),
           ("tests/test_parallelize.py::test_parallelized_model_equals_plain_model[T4-1d-kv-replicated]",),
           "1D with fewer kv heads than T ranks builds unshared kv blocks (the job layout's kv replication lost)"),
    Mutant("swap-column-overlap-not-passed", "gridshard/tensor/tp1d/build.py",
           (("                                    device=META, replicate=kv_replicate if kind == \"kv_column\" else 1,\n"
             "                                    overlap_input_grad=overlap_input_grad)\n",
             "                                    device=META, replicate=kv_replicate if kind == \"kv_column\" else 1)\n"),),
           ("tests/test_construction.py::test_parallelize_passes_options_to_constructors",),
           "parallelize's overlap_input_grad does not reach the column layers' constructors (they keep the default)"),
    Mutant("swiglu-keeps-silu", "gridshard/models/llama.py",
           (("        act = swiglu(gate, up)\n", "        act = self.activation(gate, up)\n"),),
           ("tests/test_memory_model.py", "-k", "equal_the_formula and T2-1d and none and fp32"),
           "the SwiGLU written plainly keeps silu(g): one f-wide tensor per layer more than documented"),
    Mutant("experts-swiglu-keeps-silu", "gridshard/moe/experts.py",
           (("        return grouped_linear(swiglu(gate, up), self.down_proj, counts)\n",
             "        return grouped_linear(torch.nn.functional.silu(gate) * up, self.down_proj, counts)\n"),),
           ("tests/test_moe_layer.py", "-k", "keep_g_and_u"),
           "the experts' SwiGLU written plainly keeps silu(g): one f_e-wide tensor per routed row more than priced"),
    Mutant("rebuild-norm-without-weight", "gridshard/nn/norm.py",
           (("        return offer_to(region, xhat * weight, torch.mul, xhat, weight)\n",
             "        return offer_to(region, xhat * weight, torch.mul, xhat, torch.ones_like(weight))\n"),),
           ("tests/test_rebuild.py", "-k", "bit_for_bit and fp32"),
           "selective's rebuilt norm output forgets the norm weight: the q|k|v / gate|up weight gradients "
           "read x̂ instead of y"),
    Mutant("rebuild-keeps-the-tensor", "gridshard/nn/rebuild.py",
           (("            if rebuilt is not None:\n                return rebuilt\n", ""),),
           ("tests/test_memory_model.py", "-k", "equal_the_formula and T2-1d-SP and selective and bf16"),
           "the pack hook recognises the norm outputs and silu(g)·u but keeps them anyway: selective "
           "keeps 2·R·e + N·f·e per layer more than documented"),
    Mutant("decoder-layers-miss-vit", "gridshard/parallel/decoder_layers.py",
           (("DECODER_LAYER = re.compile(r\"^((model\\.)?layers|vit\\.encoder\\.layer)\\.\\d+$\")\n",
             "DECODER_LAYER = re.compile(r\"^(model\\.)?layers\\.\\d+$\")\n"),),
           ("tests/test_vit_recompute.py::test_vit_layers_are_the_units",),
           "the ViT's encoder layers are not units: ZeRO-3 one unit, full recompute and compile do nothing for a ViT"),
    Mutant("vit-pipeline-accuracy-last-stage-only", "gridshard/engine/step.py",
           (("        hits = C.all_reduce(hits, job.mesh.pipeline, inplace=True)"
             "      # P > 1: only the last stage counted\n", ""),),
           ("tests/test_vit_train.py::test_vit_pipeline_training_matches_one_process",),
           "a pipelined classifier's accuracy is counted on the last stage only: the other stages report 0"),
    Mutant("bf16-residual-stays-fp32", "gridshard/models/llama.py",
           (("        return x.to(compute_dtype(x))\n", "        return x\n"),),
           ("tests/test_compute_dtype.py::test_activations_are_in_the_compute_dtype_under_autocast",),
           "the embedding output is not cast: the residual stream and norms stay fp32 under autocast"),
    Mutant("pipeline-stage-declares-fp32-hidden", "gridshard/pipeline/runner.py",
           (('getattr(rank_model, "hidden_dtype", lambda compute: torch.float32)(precision.dtype)',
             "torch.float32"),),
           ("tests/test_compute_dtype.py::test_bf16_pipeline_stages_send_bf16_and_match_one_process", "-m", "wide"),
           "a bf16 run's stages declare fp32 hidden states while the model sends bf16"),
    Mutant("bf16-norm-backward-drops-mean-term", "gridshard/nn/norm.py",
           (("        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))\n",
             "        dx = rstd * gw\n"),),
           ("tests/test_compute_dtype.py", "-k", "low_precision_rms_norm"),
           "the bf16/fp16 RMSNorm input gradient misses the rstd derivative"),
    Mutant("recompute-reruns-other-hooks", "gridshard/parallel/recompute.py",
           (("_checkpoint_without_reentrant_generator(mod.forward, *after_fn,",
             "_checkpoint_without_reentrant_generator(mod, *after_fn,"),),
           ("tests/test_construction.py::test_full_recompute_keeps_forward_and_recomputes",),
           "full recompute re-runs the whole module call in backward: other owners' hooks (ZeRO-3's release) run again"),
    Mutant("zero-stepped-range-not-in-chunk", "gridshard/zero/units.py",
           (("stepped[off + a - lo:off + b - lo], (a, b)))", "stepped[off + a:off + b], (a, b)))"),),
           ("tests/test_zero.py::test_zero_stages_equal_zero0_memory_and_traffic_match_theory[D4-none-odd-tied]",),
           "the optimizer steps a parameter's elements at their unit-buffer offset, not inside this rank's chunk"),
    Mutant("zero-accumulation-overwrites", "gridshard/zero/reduction.py",
           (("            (u.reduced.copy_ if u.scratch_first else u.reduced.add_)(u.scratch)\n",
             "            u.reduced.copy_(u.scratch)\n"),),
           ("tests/test_zero.py::test_zero2_accumulates_sharded_gradients_and_equals_zero0",),
           "ZeRO-2/3 sharded accumulation keeps only the last micro-batch's reduced gradient"),
    Mutant("bf16-masters-not-copied-back", "gridshard/zero/reduction.py",
           (("                u.param_chunk.copy_(u.master)\n", "                pass\n"),),
           ("tests/test_bf16_storage.py::test_bf16_zero_stages_agree_follow_fp32_and_hold_the_formula_bytes",),
           "bf16 storage under ZeRO ≥ 1: the stepped fp32 masters never reach the bf16 parameters"),
    Mutant("zero3-gather-skips-master-cast", "gridshard/zero/gather.py",
           (("            send = u.param_buffer[lo:hi].copy_(send)\n", "            send = u.param_buffer[lo:hi]\n"),),
           ("tests/test_bf16_storage.py::test_bf16_zero_stages_agree_follow_fp32_and_hold_the_formula_bytes",),
           "bf16 ZeRO-3: a gather sends its bf16 slice as it was, not the stepped fp32 master cast into it"),
    Mutant("receive-buffers-kept", "gridshard/torch_private.py",
           (("        release(stage.args_recv_info.get(chunk, ()))\n        release(stage.grad_recv_info.get(chunk, ()))\n",
             "        pass\n"),),
           ("tests/test_pipeline.py", "-k", "receive_buffers and 1f1b"),
           "pipeline stages keep every micro-batch's receive buffers (torch's default), not the in-flight ones"),
    Mutant("zero2-bf16-kept-past-its-cast", "gridshard/zero/reduction.py",
           (("            if self.stage >= 2:                        # the cast is what is sent: the bf16 buffer goes now\n"
             "                self._free_grad_buffer(u)\n", ""),),
           ("tests/test_bf16_storage.py::test_bf16_zero2_frees_each_gradient_at_its_cast",),
           "bf16 ZeRO-2/3: a unit's bf16 gradient buffer lives to the end of its reduce-scatter, beside its fp32 cast"),
    Mutant("zero-cast-before-waiting", "gridshard/zero/reduction.py",
           (("        while self.max_in_flight is not None and len(self._in_flight) >= self.max_in_flight:\n"
             "            self._finish(self._in_flight.pop(0))       # first: u's fp32 cast never joins max_in_flight others\n",
             ""),
            ("        self._in_flight.append(u)\n\n    def _all_reduce",
             "        self._in_flight.append(u)\n        while self.max_in_flight is not None and len(self._in_flight) > "
             "self.max_in_flight:\n            self._finish(self._in_flight.pop(0))\n\n    def _all_reduce")),
           ("tests/test_bf16_storage.py::test_bf16_zero2_frees_each_gradient_at_its_cast",),
           "ZeRO >= 1: the next unit is cast and issued before the oldest reduction is waited for (3 casts alive)"),
    Mutant("bf16-zero0-master-grad-not-cast", "gridshard/zero/reduction.py",
           (("            u.reduced.copy_(u.grad_buffer)\n", "            pass\n"),),
           # one micro-batch: with A > 1 the first reaches the reduced buffer through the accumulator (_accumulate)
           ("tests/test_grad_buffer.py::test_bf16_buckets_hold_the_fp32_master_gradient_instead_of_the_bf16_buffer",),
           "bf16 ZeRO-0: the bucket's bf16 gradients never reach its fp32 master gradient (stale values reduced)"),
    Mutant("bf16-zero0-grad-buffer-kept", "gridshard/zero/reduction.py",
           (("        self._free_grad_buffer(u)\n        return u.reduced\n", "        return u.reduced\n"),),
           ("tests/test_grad_buffer.py::test_bf16_buckets_hold_the_fp32_master_gradient_instead_of_the_bf16_buffer",),
           "bf16 ZeRO-0 keeps each bucket's bf16 gradient buffer beside its fp32 master gradient (20Ψ, not 18Ψ)"),
    Mutant("zero0-norm-over-data", "gridshard/zero/data_parallel.py",
           (("        return self.axis if self.stage else None\n", "        return self.axis\n"),),
           ("tests/test_train_equivalence.py::test_layout_gives_the_same_run[D2-T1-none]",),
           "ZeRO-0 sums the gradient norm over data ranks too, though every rank holds the whole gradients"),
    Mutant("bf16-reduce-first-chunk-added", "gridshard/zero/reduction.py",
           (("            (u.reduced.copy_ if u.scratch_first else u.reduced.add_)(u.scratch)\n",
             "            u.reduced.add_(u.scratch)\n"),),
           ("tests/test_bf16_storage.py::test_bf16_gradient_reduction_moves_bf16_bytes",),
           "bf16 reduce-scatter: the step's first reduced chunk is added to the previous step's instead of replacing it"),
    Mutant("bf16-accumulator-overwritten", "gridshard/zero/reduction.py",
           (("            u.accum.add_(u.grad_buffer)\n        else:\n",
             "            u.accum.copy_(u.grad_buffer)\n        else:\n"),),
           ("tests/test_bf16_storage.py::test_bf16_zero01_accumulate_micro_batches_in_fp32_as_zero2",),
           "bf16 ZeRO-0/1: a micro-batch's gradients replace the fp32 accumulator instead of adding to it"),
    Mutant("bf16-accumulated-buffer-not-zeroed", "gridshard/zero/reduction.py",
           (("        u.grad_buffer.zero_()\n\n    def _drop_accum", "\n    def _drop_accum"),),
           ("tests/test_bf16_storage.py::test_bf16_zero01_accumulate_micro_batches_in_fp32_as_zero2",),
           "bf16 ZeRO-0/1: the bf16 buffer keeps a micro-batch already added into the fp32 accumulator (counted twice)"),
    Mutant("ckpt-tied-copy-written-twice", "gridshard/checkpoint/blocks.py",
           (('    return getattr(model, "has_first", True) or name != getattr(model, "embedding_weight_name", None)',
             "    return True"),),
           ("tests/test_zero.py::test_pipeline_tied_zero2_checkpoint_writes_the_tied_weight_once", "-m", "wide"),
           "both pipeline copies of a tied embedding are saved under ZeRO: overlapping chunks, the load fails"),
    Mutant("flat-range-partial-first-row-dropped", "gridshard/theory/zero.py",
           (("    if col0:                                                    # partial first row\n",
             "    if False:                                                   # partial first row\n"),),
           ("tests/test_sharding.py", "-k", "flat_range"),
           "an element range that starts inside a row loses that partial row (a ZeRO shard saved incompletely)"),
    Mutant("prepare-no-eos-between-documents", "gridshard/data/prepare.py",
           (("            if last is not None:\n                put(eos)\n", "            pass\n"),),
           ("tests/test_prepare_data.py::test_trained_bpe_round_trip_then_reused",),
           "prepare-data ends only the last document with <|endoftext|>: the others run into the next one"),
    Mutant("peak-flops-substring-match", "gridshard/peak_flops.py",
           (("    peaks = _BY_NORMALISED.get(normalise_device_name(device_name))\n",
             "    peaks = next((v for k, v in _BY_NORMALISED.items() if k in normalise_device_name(device_name)), "
             "None)\n"),),
           ("tests/test_gpu_readiness.py::test_peak_flops_by_exact_device_name",),
           "peak FLOPs found by substring of the device name: a name the table lacks gets a neighbour's figures"),
    Mutant("gloo-rank-on-cuda", "gridshard/device.py",
           (("    if backend != \"nccl\":\n        return torch.device(\"cpu\")\n",
             "    if not torch.cuda.is_available():\n        return torch.device(\"cpu\")\n"),),
           ("tests/test_gpu_readiness.py::test_backend_and_device_follow_the_config_and_the_machine",),
           "the device taken from the machine, not the backend: gloo ranks on a GPU host land on CUDA"),
    Mutant("mesh-groups-default-timeout", "gridshard/mesh.py",
           (("    if world_timeout is not None:\n        set_collective_timeout(mesh.groups(), world_timeout)\n",
             "    pass\n"),),
           ("tests/test_gpu_readiness.py::test_mesh_groups_wait_the_collective_timeout_and_compile_warms_up_with_a_longer_one",),
           "the mesh's sub-groups keep torch's default timeout (NCCL 10 min, gloo 30 min), not collective_timeout_s"),
    Mutant("pipeline-busy-host-time-on-cuda", "gridshard/pipeline/meter.py",
           (("        if not self.cuda:\n            t0 = time.perf_counter()", "        if True:\n            t0 = time.perf_counter()"),),
           ("tests/test_gpu_readiness.py::test_region_timer_on_cuda_reads_events_without_a_host_sync_per_region",),
           "pipeline busy/bubble time measured on the host on CUDA (kernel launches, not kernels)"),
    Mutant("tp2p5d-reducer-without-depth", "gridshard/mesh.py",
           (("    replicas = weight_replica_dims(outer_names) + layer_mode.weight_replica_dims()",
             '    replicas = tuple(n for n in weight_replica_dims(outer_names) if n != "depth") + '
             'layer_mode.weight_replica_dims()'),),
           ("tests/test_tp2p5d_model.py", "-m", "wide", "-k", "one_process_run and zero0"),
           "2.5D training reduces gradients over data (× context) only: each depth layer keeps its batch slice's "
           "gradient (the one depth sum in training is the reducer's)"),
    Mutant("tp2p5d-same-batch-slice-every-layer", "gridshard/tensor/tp2d/scheme.py",
           (("        mesh.batch_index = mesh.depth.rank * mesh.q + mesh.grid_row\n",
             "        mesh.batch_index = mesh.grid_row\n"),),
           ("tests/test_tp2p5d_model.py", "-m", "wide", "-k", "one_process_run and zero0"),
           "every 2.5D depth layer trains on the first layer's batch slice"),
    Mutant("tp2p5d-boundary-block-whole-micro-batch", "gridshard/tensor/tp2p5d/scheme.py",
           (("        return mode.boundary_block(layer_T, sequence_parallel, micro // depth, seq, hidden)\n",
             "        return mode.boundary_block(layer_T, sequence_parallel, micro, seq, hidden)\n"),),
           ("tests/test_tp2p5d_model.py::test_2p5d_config_rules_and_layout_facts",),
           "a 2.5D stage boundary sends the 2D block of the whole micro-batch, not of its depth layer's m/d rows"),
    Mutant("tp3d-weight-grad-wrong-axis", "gridshard/tensor/tp3d/matmul.py",
           (("    return C.reduce_scatter(x_full.t() @ g_full, mesh.weight, 0)\n",
             "    return C.reduce_scatter(x_full.t() @ g_full, mesh.input, 0)\n"),),
           ("tests/test_tp3d_layers.py::test_linear_norm_chain_two_micro_batches", "-m", "wide"),
           "the 3D weight gradient X_ilᵀ·dY_ij is summed over the input axis, not over the weight axis its "
           "all-gather ran on (not the dual)"),
    Mutant("tp3d-loss-count-one-row", "gridshard/tensor/tp3d/cross_entropy.py",
           (("    grid = _LossGrid(mesh.q ** 2, mesh.output, mesh.batch, mesh.batch_index, mesh.hidden_index)\n",
             "    grid = _LossGrid(mesh.q ** 2, mesh.output, mesh.weight, mesh.batch_index, mesh.hidden_index)\n"),),
           ("tests/test_tp3d_layers.py", "-m", "wide", "-k", "embedding_head_loss"),
           "the 3D loss sums its (loss, count) over q of the q² batch blocks, not the micro-batch"),
    # ---- 3D training (issue 24): the seams between mesh, model, trainer, planner and memory model ----
    Mutant("tp3d-targets-at-tokens-block", "gridshard/tensor/tp3d/scheme.py",
           (("        return mesh.cube.swapped().batch_index\n",
             "        return mesh.batch_index\n"),),
           ("tests/test_tp3d_model.py::test_3d_config_rules_and_layout_facts",),
           "3D targets cut at the tokens' batch block i·q + j, not the logits' block i·q + l of the swapped "
           "orientation (ranks with j ≠ l compare logits with another block's targets)"),
    Mutant("tp3d-trainer-cuts-targets-as-tokens", "gridshard/engine/step.py",
           (("targets = batch_to_device(self.context.shard_targets(targets), self.device)",
             "targets = batch_to_device(self.context.shard_tokens(targets), self.device)"),),
           ("tests/test_tp3d_model.py::test_3d_training_gives_the_one_process_run_and_resumes_at_2p5d",),
           "the trainer cuts targets with shard_tokens (right in every mode but 3D, where the logits come out "
           "in the swapped orientation)"),
    Mutant("tp3d-row-on-residual-orientation", "gridshard/tensor/tp3d/build.py",
           (('        on = mesh.swapped() if kind == "row" else mesh\n', "        on = mesh\n"),),
           ("tests/test_tp3d_model.py::test_3d_training_gives_the_one_process_run_and_resumes_at_2p5d",),
           "build_3d lays o_proj / down_proj on the residual orientation: they read the attention / MLP output "
           "(swapped layout) as if it were residual blocks"),
    Mutant("tp3d-tied-head-wrong-hidden-subblock", "gridshard/tensor/tp3d/tied_head.py",
           (("w = table.chunk(q, 0)[mesh.input.rank].chunk(q, 1)[mesh.weight.rank]",
             "w = table.chunk(q, 0)[mesh.input.rank].chunk(q, 1)[mesh.output.rank]"),),
           ("tests/test_tp3d_model.py::test_3d_hugging_face_llama_gives_the_one_process_run[tied]", "-m", "wide"),
           "the tied 3D head keeps hidden sub-block l of the gathered table (its own hidden block's index) "
           "instead of sub-block i, the weight coordinate its product contracts"),
    Mutant("tp3d-clip-origin-only", "gridshard/engine/clip.py",
           (('basis = set(index) - {"tensor"} or {"tensor"}',
             'basis = set(index) - {"tensor", "weight", "input", "output"} or {"tensor"}'),),
           ("tests/test_tp3d_model.py::test_3d_training_gives_the_one_process_run_and_resumes_at_2p5d",),
           "3D clipping falls back to 1D's tensor coordinate: a cube-split block is counted by tensor rank 0 only "
           "(global norm too small, clipping too weak)"),
    Mutant("vit-2p5d-accuracy-over-data-only", "gridshard/engine/step.py",
           (("hits = C.all_reduce(hits.reshape(1), job.mesh.data_context, inplace=True)",
             "hits = C.all_reduce(hits.reshape(1), job.mesh.data, inplace=True)"),),
           ("tests/test_vit_2p5d.py::test_vit_2p5d_training_matches_one_process[zero0]", "-m", "wide"),
           "a ViT's accuracy summed over data ranks only: at 2.5D each depth layer counts its own batch slice"),
    Mutant("planner-3d-cube-order-reversed", "gridshard/tensor/tp3d/theory.py",
           (("    t = lambda i, j, l: (i * q + j) * q + l  # noqa: E731\n",
             "    t = lambda i, j, l: (l * q + j) * q + i  # noqa: E731\n"),),
           ("tests/test_planner_3d.py::test_3d_priced_from_its_theory_axis_by_axis",),
           "the planner's cube groups with output outermost: the output axis (q consecutive ranks) priced as "
           "crossing nodes, the weight axis as staying inside one"),
    Mutant("planner-3d-axes-on-tensor-link", "gridshard/planner/price_tensor.py",
           (('levels = pr.levels.get("tensor_axes", {})', "levels = {}"),),
           ("tests/test_planner_3d.py::test_explain_says_why_3d_wins_against_2d_and_2p5d_at_the_same_t",),
           "every 3D axis priced on the whole cube's link (inter-node once T spans nodes), though output and "
           "input stay inside a node"),
    Mutant("tp3d-memory-tied-head-copy-forgotten", "gridshard/tensor/tp3d/scheme.py",
           (("        extra = tied_head_saved_bytes(cfg, T, e) if getattr(cfg, \"tie_embeddings\", False) else 0\n",
             "        extra = 0\n"),),
           ("tests/test_planner_3d.py::test_3d_memory_is_one_over_t_and_the_meta_model_s",),
           "the 3D memory model forgets the tied head's saved copy of its weight slice [V_p/q, h/q²]",
           ("also killed by the wide 8-rank tests/test_planner_3d.py::test_3d_memory_model_equals_the_tensors_of_"
            "eight_ranks (the meter)",)),
    Mutant("tp3d-theory-row-projections-unswapped", "gridshard/tensor/tp3d/theory.py",
           (("linear3d_comm(n, hidden, hidden, q, e, swapped=True),", "linear3d_comm(n, hidden, hidden, q, e),"),
            ("linear3d_comm(n, ffn, hidden, q, e, swapped=True))", "linear3d_comm(n, ffn, hidden, q, e))")),
           ("tests/test_planner_3d.py::test_3d_priced_from_its_theory_axis_by_axis",),
           "the 3D block's theory puts o_proj / down_proj on the residual orientation: their activations priced on "
           "the wrong activation axis (same ring bytes in all, so only the per-axis split shows it)"),
    Mutant("import-graph-lazy-edges-dropped", "scripts/import_graph.py",
           (("                    (eager if is_eager else lazy)[src].add(dst)\n",
             "                    if is_eager:\n                        eager[src].add(dst)\n"),),
           ("tests/test_import_graph.py",),
           "the import graph forgets function-level imports: a cycle through a lazy import goes unseen"),
    Mutant("context-loss-weight-without-context", "gridshard/engine/step.py",
           (("    weight = job.mesh.data_context.size / n_valid if n_valid else 0.0",
             "    weight = job.mesh.data.size / n_valid if n_valid else 0.0"),),
           ("tests/test_context_training.py", "-k", "C4-ring"),
           "the loss weight D/N forgets the context ranks the reducer averages over: gradients C times too small"),
    Mutant("context-rope-local-positions", "gridshard/models/rope.py",
           (("                    cos, sin = cos[at], sin[at]\n", "                    cos, sin = cos[:seq_len], sin[:seq_len]\n"),),
           ("tests/test_context_training.py", "-k", "C4-ring"),
           "RoPE at local positions 0 … 2c − 1 on every context rank instead of the chunks' global positions"),
    Mutant("context-memory-tokens-not-split", "gridshard/theory/memory/activations.py",
           (("    s_r = seq_len // context                     # the rank's 2c tokens of every sequence",
             "    s_r = seq_len                                # the rank's 2c tokens of every sequence"),),
           ("tests/test_memory_model.py", "-k", "context_term_by_hand"),
           "the memory model keeps every per-token activation of the whole sequence at C > 1"),
    Mutant("context-memory-output-copy-forgotten", "gridshard/theory/context.py",
           (("    return token_rows * heads * head_dim * e\n", "    return 0\n"),),
           ("tests/test_memory_model.py", "-k", "context_term_by_hand"),
           "the C > 1 attention term (o_proj's copy of the context attention output) left out"),
    Mutant("planner-context-zero-over-data-only", "gridshard/planner/cost_memory.py",
           (("            data=layout.data * layout.context, data_rank=0,", "            data=layout.data, data_rank=0,"),),
           ("tests/test_planner.py", "-k", "context_memory_and_time"),
           "the planner shards ZeRO over D instead of the reducer's D·C data × context ranks"),
    Mutant("context-ring-diagonal-not-causal", "gridshard/context/ring_attention.py",
           (("kernel.forward(qs[qi], ks[ki], vs[ki], scale, causal)",
             "kernel.forward(qs[qi], ks[ki], vs[ki], scale, False)"),),
           ("tests/test_context_attention.py", "-k", "c1"),
           "the ring's diagonal block computed without its causal mask: queries see later keys of their chunk"),
    Mutant("context-ring-block-on-matmul", "gridshard/context/blocks.py",
           (("        return CPU\n", "        return MATMUL\n"),),
           ("tests/test_context_attention.py", "-k", "score_matrix"),
           "the ring's CPU block product on plain matmuls: a c × c fp32 score matrix per head and block again"),
    Mutant("context-hf-local-positions", "gridshard/models/hf.py",
           (("    return global_positions(local_len, C, rank, device=device).unsqueeze(0)\n",
             "    return torch.arange(local_len, device=device).unsqueeze(0)\n"),),
           ("tests/test_context_hf.py", "-k", "C4-ring-untied", "-m", "wide"),
           "a Hugging Face Llama's position_ids 0 … 2c − 1 on every context rank: its rotary embedding at local "
           "positions instead of the chunks' global ones"),
    Mutant("zero-pipeline-whole-gradients", "gridshard/theory/zero.py",
           (("    return pipeline == 1 or (zero >= 2 and schedule in SHARDED_ACCUMULATION_SCHEDULES)\n",
             "    return pipeline == 1\n"),),
           ("tests/test_pipeline.py::test_pipeline_run_equals_one_device[D2-P2-none-gpipe-tied]",),
           "ZeRO-2/3 with pipeline stages keep whole gradients to sync(): no sharded accumulation (issue 23)"),
    Mutant("zero-tied-root-not-deferred", "gridshard/zero/reduction.py",
           (('        return self.sharded_accumulation and not (self.defer_root and u.name == "root")\n',
             "        return self.sharded_accumulation\n"),),
           ("tests/test_pipeline.py::test_pipeline_run_equals_one_device[D2-P2-none-gpipe-tied]",),
           "a pipeline's tied-embedding root reduce-scattered per micro-batch: the cross-stage sum finds no gradient"),
]


# ---- snapshot --------------------------------------------------------------------------------------------------
def _git(*args) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True).stdout


def _copy_listed(names, dest):
    for name in names:
        src = os.path.join(ROOT, name)
        if not os.path.isfile(src):          # deleted in the working tree, or a submodule
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, name))


def snapshot(dest: str, rev: str | None) -> None:
    """The repository's files (no .git, no ignored files) into ``dest``."""
    untracked = [n for n in _git("ls-files", "-z", "--others", "--exclude-standard").decode().split("\0") if n]
    if rev is None:
        tracked = [n for n in _git("ls-files", "-z", "--cached").decode().split("\0") if n]
        _copy_listed(tracked, dest)
    else:
        archive = os.path.join(dest, ".snapshot.tar")
        with open(archive, "wb") as f:
            f.write(_git("archive", "--format=tar", rev))
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        os.remove(archive)
    _copy_listed(untracked, dest)


# ---- one mutant ------------------------------------------------------------------------------------------------
def apply(mutant: Mutant, tree: str) -> str | None:
    """Apply the edits inside ``tree``; None, or why they could not be applied."""
    path = os.path.join(tree, mutant.file)
    if not os.path.isfile(path):
        return f"{mutant.file} does not exist"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for original, replacement in mutant.edits:
        n = text.count(original)
        if n != 1:
            first = original.strip().splitlines()[0]
            return f"snippet found {n}× (need exactly 1) in {mutant.file}: {first!r}"
        text = text.replace(original, replacement)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return None


def run_tests(tree: str, tests, timeout: float):
    """(pytest exit code or None on timeout, seconds, output tail) for ``tests`` run inside ``tree``."""
    path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path,
               PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # pytest and its rank workers (its own session)
        out, _ = proc.communicate()
        code = None
    return code, time.monotonic() - t0, out.decode(errors="replace")[-3000:]


def check_imports_from_copy(tree: str) -> None:
    """The copy's gridshard must shadow the editable install, or every mutant would 'survive'."""
    out = subprocess.run([sys.executable, "-c", "import gridshard, os; print(os.path.realpath(gridshard.__file__))"],
                         cwd=tree, env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True)
    where = out.stdout.strip()
    if not where.startswith(os.path.realpath(tree)):
        sys.exit(f"mutants: the scratch copy imports gridshard from {where or out.stderr!r}, not from {tree}")


def run_mutant(mutant: Mutant, base: str, baseline: bool, timeout: float, verbose: bool) -> dict:
    row = {"id": mutant.id, "file": mutant.file, "tests": " ".join(mutant.tests), "seconds": 0.0, "detail": ""}
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.id}-") as scratch:
        tree = os.path.join(scratch, "repo")
        shutil.copytree(base, tree, symlinks=True)
        if baseline:
            code, secs, out = run_tests(tree, mutant.tests, timeout)
            row["seconds"] += secs
            if code != 0:
                row.update(status="error", detail=f"tests fail WITHOUT the mutant (exit {code}):\n{out}")
                return row
        problem = apply(mutant, tree)
        if problem:
            row.update(status="snippet?", detail=problem)
            return row
        code, secs, out = run_tests(tree, mutant.tests, timeout)
        row["seconds"] += secs
    if code == 1:
        row["status"] = "killed"
    elif code == 0:
        row.update(status="SURVIVED", detail=f"every named test passed with the mutant applied:\n{out}")
    else:
        why = "timeout" if code is None else f"pytest exit {code} (no test failure: missing test id, " \
                                              f"collection error, ...)"
        row.update(status="error", detail=f"{why}:\n{out}")
    if verbose and row["status"] == "killed":
        row["detail"] = out
    return row


# ---- main ------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", metavar="ID", help="run only this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--baseline", action="store_true", help="first check each mutant's tests pass unmutated")
    ap.add_argument("--rev", metavar="REV", help="tracked files from this commit instead of the working tree")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per pytest run (default 600)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the pytest output of every mutant")
    args = ap.parse_args(argv)

    chosen = MUTANTS
    if args.only:
        known = {m.id for m in MUTANTS}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            print(f"unknown mutant id(s) {unknown}; known: {sorted(known)}", file=sys.stderr)
            return 2
        chosen = [m for m in MUTANTS if m.id in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.id:<26} {m.file:<34} {' '.join(m.tests)}\n{'':<26} {m.why}")
            for note in m.notes:
                print(f"{'':<26} note: {note}")
        return 0

    rows = []
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutants-base-") as base_dir:
        base = os.path.join(base_dir, "repo")
        os.makedirs(base)
        snapshot(base, args.rev)
        check_imports_from_copy(base)
        source = f"commit {args.rev} + untracked files" if args.rev else "working tree (uncommitted changes included)"
        print(f"mutants: {len(chosen)} of {len(MUTANTS)}, snapshot of the {source}", flush=True)
        for m in chosen:
            print(f"  {m.id} ...", end=" ", flush=True)
            row = run_mutant(m, base, args.baseline, args.timeout, args.verbose)
            print(f"{row['status']} ({row['seconds']:.0f} s)", flush=True)
            rows.append(row)

    width = max(len(r["id"]) for r in rows)
    print()
    print(f"{'mutant':<{width}}  {'status':<9} {'time':>6}  killing test(s)")
    print(f"{'-' * width}  {'-' * 9} {'-' * 6}  {'-' * 15}")
    for r in rows:
        print(f"{r['id']:<{width}}  {r['status']:<9} {r['seconds']:>5.0f}s  {r['tests']}")
    bad = [r for r in rows if r["status"] != "killed"]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} killed in {time.monotonic() - t_all:.0f} s")
    for r in rows:
        if r["detail"] and (r["status"] != "killed" or args.verbose):
            print(f"\n--- {r['id']}: {r['status']} ---\n{r['detail']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
