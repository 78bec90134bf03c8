"""A training job's MoE duties around each optimizer step (docs/moe.md): the aux loss's gradient
weight, the step's routing statistics over all ranks, the balancing-bias update and the metrics.

Gradient weight. The step backpropagates L_da · D·C/N per micro-batch and the reducer averages
over the D·C data(-context) ranks (:mod:`gridshard.engine.step`), so a rank's Σ_b L_b enters with
weight w = α·D·C/B for the step to optimise α·Σ_b L_b / B over the B sequences of the global
batch (times the fp16 loss scale, which the unscale divides out again).

Statistics. Each MoE block sums its calls' Σ_b L_b, kept slots per expert, slots and drops
(:class:`gridshard.moe.layer.MoEBlock`); after the step they are laid into one table of every MoE
layer of the model (a pipeline rank fills its stages' rows) and summed over the data(-context)
ranks and the pipeline ranks (one all-reduce each), so every rank holds the same totals, applies
the same bias update and reports the same metrics:

    moe_aux_loss = α · Σ_layers Σ_b L_b / B           (the term the step added to the loss)
    moe_load_max = max over layers of max_e c_e / mean_e c_e
    moe_dropped  = Σ dropped slots / Σ slots
    moe_load     = [Σ_layers c_e / Σ_layers Σ_e c_e for each expert e]   (each expert's share; 1/n balanced)
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm.collectives import all_reduce
from .layer import MoEBlock


class MoETraining:
    """The duties of a model whose config has MoE layers ``moe_layers`` (decoder layer indices) of
    ``n_experts``, on ``mesh`` (module docstring); this rank's blocks may be some of them (a pipeline
    stage's) or none. ``device``: where the statistics are summed (the job's)."""

    def __init__(self, model: torch.nn.Module, moe_layers: list, n_experts: int, mesh, train_cfg, device):
        self.blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        self.rows, self.n = [moe_layers.index(b.layer) for b in self.blocks], n_experts
        self.table_rows, self.device = len(moe_layers), device
        self.axis, self.pipeline = mesh.data_context, mesh.pipeline
        self.coefficient, self.rate = train_cfg.moe_aux_loss, train_cfg.moe_bias_rate
        self.weight = train_cfg.moe_aux_loss * self.axis.size / train_cfg.global_batch
        self.global_batch = train_cfg.global_batch
        self.last: dict = {}
        for block in self.blocks:
            block.aux_coefficient, block.gate.capacity = self.coefficient, train_cfg.moe_capacity

    @staticmethod
    def of(model: torch.nn.Module, model_cfg, mesh, train_cfg, device) -> Optional["MoETraining"]:
        """The job's MoE duties, or None for a model config without MoE layers."""
        is_moe = getattr(model_cfg, "is_moe_layer", None)              # gridshard's Llama config only
        layers = [i for i in range(model_cfg.layers) if is_moe(i)] if is_moe is not None else []
        return MoETraining(model, layers, model_cfg.experts, mesh, train_cfg, device) if layers else None

    def begin(self, loss_scale: Optional[float]) -> None:
        """Before the step's first forward: statistics zeroed, the aux gradient weight set."""
        for block in self.blocks:
            block.reset_stats()
            block.aux_weight = self.weight * (loss_scale or 1.0)

    def end(self, update_bias: bool) -> dict:
        """After the step's backward (every rank): the summed statistics, the bias update (unless
        the step's update was skipped) and the metrics (module docstring), also kept in ``last``."""
        n = self.n
        table = torch.zeros(self.table_rows, n + 3, dtype=torch.float64, device=self.device)
        for row, b in zip(self.rows, self.blocks):
            table[row] = torch.cat([b.aux_sum.double().view(1), b.load.double(), b.dropped.double().view(1),
                                    b.slots.double().view(1)])
        totals = all_reduce(all_reduce(table, self.axis, inplace=True), self.pipeline, inplace=True)
        aux, load, dropped, slots = totals[:, 0], totals[:, 1:n + 1], totals[:, n + 1], totals[:, n + 2]
        if update_bias and self.rate:
            for row, block in zip(self.rows, self.blocks):
                block.gate.update_bias(load[row], self.rate)
        self.last = {"moe_aux_loss": float(self.coefficient * aux.sum() / self.global_batch),
                     "moe_load_max": float((load.max(1).values / load.mean(1).clamp_min(1e-30)).max()),
                     "moe_dropped": float(dropped.sum() / slots.sum().clamp_min(1)),
                     "moe_load": (load.sum(0) / load.sum().clamp_min(1)).tolist()}
        return self.last