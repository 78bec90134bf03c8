"""Generation: the KV-cached decoder gives the logits of the plain full forward (fp32, 1e-5),
cached and uncached sampling give the same text for a seed, greedy is the argmax chain, and
a checkpoint loads into the plain model in one process."""
import dataclasses

import pytest
import torch

from gridshard.generate import CachedDecoder, generate_ids, sample_next
from gridshard.models import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=97, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64, max_seq_len=40)


#: Mixture-of-Experts layers (every second one, a shared expert): dropless routing is per token,
#: so the cached decoder's chunks route as the full forward does
MOE_CFG = dataclasses.replace(CFG, experts=4, experts_per_token=2, shared_experts=1, moe_every=2, expert_ffn_hidden=24)


def _model(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    m = Transformer(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m.eval()


@pytest.mark.parametrize("cfg", [CFG, MOE_CFG], ids=["dense", "moe"])
def test_cached_logits_equal_the_full_forward(cfg):
    m = _model(cfg=cfg)
    tokens = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        full = m(tokens)
    dec = CachedDecoder(m)
    parts = [dec.step(tokens[:, :11]), dec.step(tokens[:, 11:12]), dec.step(tokens[:, 12:20])]
    parts += [dec.step(tokens[:, i:i + 1]) for i in range(20, 30)]
    got = torch.cat(parts, 1)
    assert (got - full).abs().max() / full.abs().max() < 1e-5


def test_sampling_cached_equals_uncached_and_greedy_is_argmax():
    m = _model(1)
    prompt = [5, 17, 3, 88]
    for temperature, top_k in ((0.0, None), (1.0, None), (0.7, 5)):
        a = generate_ids(m, prompt, 30, temperature, top_k, seed=4)
        b = generate_ids(m, prompt, 30, temperature, top_k, seed=4, use_cache=False)
        assert a == b and len(a) == 30, (temperature, top_k)
    ids = list(prompt)
    for _ in range(5):
        with torch.no_grad():
            ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
    assert generate_ids(m, prompt, 5, 0.0) == ids[4:]
    assert generate_ids(m, prompt, 30, 1.0, seed=4) != generate_ids(m, prompt, 30, 1.0, seed=5)
    # past the model's window the context slides: still max_new_tokens ids, all in the vocabulary
    long = generate_ids(m, prompt, 80, 1.0, seed=1)
    assert len(long) == 80 and max(long) < 97


def test_top_k_keeps_only_the_k_largest():
    gen = torch.Generator().manual_seed(0)
    z = torch.tensor([0.0, 5.0, 4.9, -1.0, 4.8])
    assert {sample_next(z, 10.0, 2, gen) for _ in range(200)} == {1, 2}
    assert sample_next(z, 0.0, 2, gen) == 1
