"""``gridshard generate``: sample text from a trained model, in one process, from a checkpoint
written at any layout (its canonical tensors are the plain model's, so no process group is
needed), verified completely first like every reader (:mod:`gridshard.checkpoint.reader`).

Decoding with a KV cache. For the prompt (the *prefill*, s₀ tokens) the model runs once with
causal attention and every layer keeps its keys and values K, V [b, K_heads, s₀, d] (after
RoPE). Each new token then costs one position: its query q at absolute position p attends to
the cached K, V of positions 0..p (no mask is needed: every cached position is ≤ p), and its
own k, v are appended — O(p) work per token instead of the O(p²) of re-running the whole
window. RoPE rotates q and k by their absolute positions, so cached keys stay valid; the
(cos, sin) tables are the model's own (``Transformer.rope_cache``), built once for the whole
window (``max_seq_len`` rows; row p depends on p alone, so a slice equals a table built to
any length) and sliced to positions pos … pos + n − 1 at every step.

The model was trained on windows of at most ``max_seq_len`` tokens starting at position 0;
when prompt + continuation outgrow it, the context is cut to its last ``max_seq_len − 1``
tokens and prefilled again (a sliding window; one full pass per cut).

Sampling of the next id from logits z [V]: temperature T = 0 → argmax z (greedy); else
p ∝ exp(z/T) restricted to the ``top_k`` largest z when given, drawn with a
``torch.Generator`` seeded by ``--seed`` (the same seed and prompt give the same text).
Generation stops early at the tokenizer's ``<|endoftext|>``, if it has one.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from .data.tokenizer import run_tokenizer
from .errors import ConfigError
from .models.llama import Transformer
from .models.rope import apply_rope
from .models.vit import saved_model_config


def load_model(folder: str, checked=None) -> tuple:
    """(plain :class:`Transformer` with the checkpoint's weights, the run's config dict).
    The checkpoint is verified completely before a tensor is read — manifest sizes and
    sha256, ``meta.json`` against the tensors, tensors only
    (:func:`gridshard.checkpoint.reader.open_checkpoint`) — so damaged or planted weights are
    refused with one CheckpointError, never sampled from. ``checked``: the already verified
    checkpoint, if any."""

    from .checkpoint.reader import open_checkpoint, read_tensors

    checked = checked or open_checkpoint(folder)
    config = checked.meta["config"]
    if config["model"].get("hf_config"):
        raise ConfigError(f"checkpoint {folder!r} holds a Hugging Face architecture (model.hf_config): "
                          f"`gridshard generate` runs gridshard's own model. Fix: `gridshard export {folder} --to hf "
                          f"OUT` and generate with transformers.")
    if config["model"].get("kind") == "vit":
        raise ConfigError(f"checkpoint {folder!r} holds a Vision Transformer (model.kind=vit), an image classifier: "
                          f"`gridshard generate` continues text. Fix: `gridshard predict {folder} IMAGE...`.")
    model = Transformer(saved_model_config(config["model"]))
    state = read_tensors(checked)
    if model.cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    model.load_state_dict(state, strict=True)
    return model.eval(), config


class CachedDecoder:
    """A :class:`Transformer`'s forward over new positions with a per-layer KV cache (module
    docstring). ``step(tokens [b, n])`` → logits [b, n, V] of those positions."""

    def __init__(self, model: Transformer):
        self.model, self.cfg = model, model.cfg
        self.reset()

    def reset(self):
        self.cache: List[Optional[tuple]] = [None] * len(self.model.layers)
        self.pos = 0

    def _rope_rows(self, n: int, device) -> tuple:
        """The RoPE (cos, sin) rows of positions pos … pos + n − 1, sliced from the model's cached
        table of the whole window (module docstring): no table is built per step."""
        length = max(self.cfg.max_seq_len, self.pos + n)
        cos, sin = self.model.rope_cache.get(length, self.cfg.head_dim, self.cfg.rope_theta, device)
        return cos[self.pos:self.pos + n], sin[self.pos:self.pos + n]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        m, n = self.model, tokens.shape[1]
        cos, sin = self._rope_rows(n, tokens.device)
        x = m.embed_tokens(tokens)
        b = x.shape[0]
        for i, layer in enumerate(m.layers):
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q, k, v = (proj(h).view(b, n, -1, attn.head_dim).transpose(1, 2)
                       for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.cache[i] is not None:
                k, v = torch.cat([self.cache[i][0], k], 2), torch.cat([self.cache[i][1], v], 2)
            self.cache[i] = (k, v)
            # the prefill is causal; later, query j sits at position pos + j and sees keys 0 .. pos + j
            mask = None if self.pos == 0 else torch.arange(k.shape[2])[None, :] <= (self.pos + torch.arange(n))[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=q.shape[1] != k.shape[1])
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.pos += n
        return m.lm_head(m.norm(x))


def sample_next(logits: torch.Tensor, temperature: float, top_k: Optional[int], gen: torch.Generator) -> int:
    """One id from logits [V] (module docstring)."""
    if temperature == 0:
        return int(logits.argmax())
    z = logits.float() / temperature
    if top_k is not None and top_k < z.numel():
        kth = torch.topk(z, top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(z, -1), 1, generator=gen))


def generate_ids(model: Transformer, prompt: List[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, seed: int = 0, eos_id: Optional[int] = None,
                 use_cache: bool = True) -> List[int]:
    """The new ids after ``prompt`` (module docstring); ``use_cache=False`` re-runs the whole
    window for every token (the reference the cache is tested against)."""
    gen = torch.Generator().manual_seed(seed)
    window = model.cfg.max_seq_len
    ids, out = list(prompt), []
    dec = CachedDecoder(model)
    logits = None
    for _ in range(max_new_tokens):
        if logits is None or not use_cache or dec.pos >= window:
            dec.reset()
            context = ids[-(window - 1):] if use_cache else ids[-window:]
            logits = dec.step(torch.tensor([context]))[0, -1]
        nxt = sample_next(logits, temperature, top_k, gen)
        out.append(nxt)
        ids.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
        logits = dec.step(torch.tensor([[nxt]]))[0, -1] if use_cache and dec.pos < window else None
    return out


def generate_text(path: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: Optional[int] = 50, seed: int = 0) -> tuple:
    """(prompt, continuation, checkpoint folder, step) for a run directory or checkpoint ``path``."""
    from .checkpoint import resolve_checkpoint
    from .checkpoint.reader import open_checkpoint

    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={max_new_tokens} is invalid: at least one token is generated. Fix: "
                          f"use e.g. 200.")
    if temperature < 0:
        raise ConfigError(f"--temperature={temperature} is invalid: it must be >= 0 (0 = greedy). Fix: use e.g. 0.8.")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k={top_k} is invalid: it keeps the k most likely ids, k >= 1. Fix: use e.g. 50.")
    folder = resolve_checkpoint(path, None)
    checked = open_checkpoint(folder)
    model, config = load_model(folder, checked)
    tok = run_tokenizer(config, folder)
    ids = tok.encode(prompt)
    if not ids:
        raise ConfigError("--prompt is empty: generation continues a prompt. Fix: pass some text, e.g. "
                          "--prompt 'def '.")
    if max(ids) >= model.cfg.vocab_size:
        raise ConfigError(f"the prompt encodes to id {max(ids)} but the model's vocabulary is {model.cfg.vocab_size}. "
                          f"Fix: use the tokenizer the run trained with.")
    new = generate_ids(model, ids, max_new_tokens, temperature, top_k, seed, tok.eos_id)
    return prompt, tok.decode(new), folder, checked.step
