"""A training job's MoE duties around each optimizer step (docs/moe.md): the aux loss's gradient
weight, the step's routing statistics over all ranks, the balancing-bias update and the metrics.

Gradient weight. The step backpropagates L_da · D·C/N per micro-batch and the reducer averages
over the D·C data(-context) ranks (:mod:`gridshard.engine.step`), so a rank's Σ_b L_b enters with
weight w = α·D·C/B for the step to optimise α·Σ_b L_b / B over the B sequences of the global
batch (times the fp16 loss scale, which the unscale divides out again).

Statistics. Each MoE block sums its calls' Σ_b L_b, kept slots per expert, slots and drops
(:class:`gridshard.moe.layer.MoEBlock`); after the step they are summed over the data(-context)
ranks in one all-reduce, so every rank holds the same totals, applies the same bias update and
reports the same metrics:

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
    def __init__(self, model: torch.nn.Module, data_axis, train_cfg):
        self.blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        self.axis, self.coefficient, self.rate = data_axis, train_cfg.moe_aux_loss, train_cfg.moe_bias_rate
        self.weight = train_cfg.moe_aux_loss * data_axis.size / train_cfg.global_batch
        self.global_batch = train_cfg.global_batch
        self.last: dict = {}
        for block in self.blocks:
            block.aux_coefficient, block.gate.capacity = self.coefficient, train_cfg.moe_capacity

    @staticmethod
    def of(model: torch.nn.Module, data_axis, train_cfg) -> Optional["MoETraining"]:
        """The job's MoE duties, or None for a model without MoE blocks."""
        found = MoETraining(model, data_axis, train_cfg)
        return found if found.blocks else None

    def begin(self, loss_scale: Optional[float]) -> None:
        """Before the step's first forward: statistics zeroed, the aux gradient weight set."""
        for block in self.blocks:
            block.reset_stats()
            block.aux_weight = self.weight * (loss_scale or 1.0)

    def end(self, update_bias: bool) -> dict:
        """After the step's backward (every rank): the summed statistics, the bias update (unless
        the step's update was skipped) and the metrics (module docstring), also kept in ``last``."""
        n = self.blocks[0].n_experts
        local = torch.cat([torch.cat([b.aux_sum.double().view(1), b.load.double(), b.dropped.double().view(1),
                                      b.slots.double().view(1)]) for b in self.blocks])
        totals = all_reduce(local, self.axis).view(len(self.blocks), n + 3)
        aux, load, dropped, slots = totals[:, 0], totals[:, 1:n + 1], totals[:, n + 1], totals[:, n + 2]
        if update_bias and self.rate:
            for block, counts in zip(self.blocks, load):
                block.gate.update_bias(counts, self.rate)
        self.last = {"moe_aux_loss": float(self.coefficient * aux.sum() / self.global_batch),
                     "moe_load_max": float((load.max(1).values / load.mean(1).clamp_min(1e-30)).max()),
                     "moe_dropped": float(dropped.sum() / slots.sum().clamp_min(1)),
                     "moe_load": (load.sum(0) / load.sum().clamp_min(1)).tolist()}
        return self.last
