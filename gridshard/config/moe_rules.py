"""The Mixture-of-Experts config rules (docs/moe.md), checked with the others by
:func:`gridshard.config.validate.validate_config`."""
from __future__ import annotations

from .rule_rows import first_broken
from .schema import MOE_MODEL_FIELDS, TrainConfig


def check_moe(cfg: TrainConfig):
    """Mixture-of-Experts fields (docs/moe.md): used only with experts, in range; every layout runs
    them. A Hugging Face config (``model.hf_config``: Mixtral, Qwen3-MoE) sets its own: explicit MoE
    fields must then say what it says (a run's saved config spells them out)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    hf = m.hf_config is not None and m.kind == "llama"
    mc = m.resolve() if hf else None
    experts = (mc.experts if hf else m.experts) or 0
    stray = [k for k in MOE_MODEL_FIELDS if getattr(m, k) is not None and not hf]
    if hf:
        first_broken([(f"model.{k}", getattr(m, k), True, f"model.hf_config={m.hf_config!r} sets it to "
                       f"{getattr(mc, k)!r}: a Hugging Face config sets its own layers", f"remove model.{k}")
                      for k in ("experts",) + MOE_MODEL_FIELDS
                      if getattr(m, k) is not None and getattr(m, k) != getattr(mc, k)])
    if experts <= 0:
        return first_broken([
            ("model.experts", experts, experts < 0, "it must be >= 0 (0: a dense model)", "use e.g. 8, or 0"),
            *((f"model.{k}", getattr(m, k), True, "it configures MoE layers but model.experts is 0 (a dense model)",
               f"set model.experts (e.g. 8) or remove model.{k}") for k in stray),
            ("train.moe_bias_rate", t.moe_bias_rate, t.moe_bias_rate != 0, "it balances MoE experts but "
             "model.experts is 0", "set model.experts or remove it"),
            ("train.moe_capacity", t.moe_capacity, t.moe_capacity is not None, "it caps MoE experts but "
             "model.experts is 0", "set model.experts or remove it"),
            ("parallel.expert", p.expert, p.expert != 1, "it splits MoE experts but model.experts is 0 (a dense "
             "model)", "set parallel.expert=1, or model.experts")])
    first_broken([
        ("model.kind", m.kind, m.kind != "llama", "Mixture-of-Experts layers are built for the decoder",
         "use model.kind: llama")])
    mc = mc or m.resolve()                             # the defaults of the fields left unset
    k, every = mc.experts_per_token, mc.moe_every
    first_broken([
        ("model.experts_per_token", k, not 1 <= k <= experts, f"each token picks k of the model.experts={experts} "
         f"experts: 1 <= k <= {experts}", f"use a value from 1 to {experts}"),
        ("model.moe_every", every, not 1 <= every <= mc.layers, f"layer i is an MoE layer when (i+1) % moe_every "
         f"== 0: 1 <= moe_every <= model.layers={mc.layers}, or no layer is one", "use 1 (every layer) or 2"),
        ("model.shared_experts", mc.shared_experts, mc.shared_experts < 0, "it must be >= 0", "use 0 or 1"),
        ("model.expert_ffn_hidden", mc.expert_ffn_hidden, mc.expert_ffn_hidden < 1, "it must be >= 1",
         "use e.g. the dense ffn_hidden / experts_per_token"),
        ("train.moe_capacity", t.moe_capacity, t.moe_capacity is not None and t.moe_capacity <= 0,
         "a capacity factor must be > 0", "use e.g. 1.25, or null for dropless routing"),
        ("parallel.expert", p.expert, experts % p.expert != 0, f"every expert rank holds the same number of "
         f"experts: parallel.expert must divide model.experts={experts}",
         f"use one of {[e for e in range(1, experts + 1) if experts % e == 0 and p.data * p.context * p.tensor_depth % e == 0]}"),
        ("train.moe_aux_loss", t.moe_aux_loss, t.moe_aux_loss < 0, "it must be >= 0 (0: off)", "use e.g. 0.01"),
        ("train.moe_bias_rate", t.moe_bias_rate, t.moe_bias_rate < 0, "it must be >= 0 (0: off)", "use e.g. 1e-3")])
