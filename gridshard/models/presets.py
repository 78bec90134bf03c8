"""Named model shapes: ``tiny`` for CPU demos and tests, and real Llama/GPT-like sizes.

Parameter count of the reference model (no biases, untied unless noted), with
h = hidden, f = ffn_hidden, v = vocab, L = layers, K kv heads of d = h/heads channels::

    N = v·h·(1 if tied else 2) + L·(2h² + 2h·K·d + 3h·f + 2h) + h

===========  ======  ======  =====  ===  ======  ======  =====  ====  ==========
preset       hidden  layers  heads  K    ffn     vocab   seq    tied  N (approx)
===========  ======  ======  =====  ===  ======  ======  =====  ====  ==========
tiny         64      2       4      4    176     256     128    no    0.13 M
125m         768     12      12     12   2048    50304   2048   yes   124 M
1.3b         2048    24      16     16   5632    50304   2048   yes   1.34 B
7b           4096    32      32     32   11008   32000   4096   no    6.74 B
13b          5120    40      40     40   13824   32000   4096   no    13.0 B
llama3-8b    4096    32      32     8    14336   128256  8192   no    8.03 B
70b          8192    80      64     8    28672   32000   4096   no    69.0 B
llama3-70b   8192    80      64     8    28672   128256  8192   no    70.6 B
===========  ======  ======  =====  ===  ======  ======  =====  ====  ==========

125m/1.3b follow GPT-3's widths with a SwiGLU MLP of ≈ 8/3·h and a tied head
(GPT-3 ties its embeddings); 7b/13b are Llama-2's shapes; ``70b`` is Llama-2-70B and
``llama3-8b`` / ``llama3-70b`` Llama-3's, all with grouped-query attention (8 kv heads).
"""
from __future__ import annotations

PRESETS: dict = {
    "tiny": dict(vocab_size=256, hidden=64, layers=2, heads=4, ffn_hidden=176, max_seq_len=128),
    "125m": dict(vocab_size=50304, hidden=768, layers=12, heads=12, ffn_hidden=2048, max_seq_len=2048,
                 tie_embeddings=True),
    "1.3b": dict(vocab_size=50304, hidden=2048, layers=24, heads=16, ffn_hidden=5632, max_seq_len=2048,
                 tie_embeddings=True),
    "7b": dict(vocab_size=32000, hidden=4096, layers=32, heads=32, ffn_hidden=11008, max_seq_len=4096),
    "13b": dict(vocab_size=32000, hidden=5120, layers=40, heads=40, ffn_hidden=13824, max_seq_len=4096),
    "llama3-8b": dict(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336,
                      max_seq_len=8192, rope_theta=500000.0),
    "70b": dict(vocab_size=32000, hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, max_seq_len=4096),
    "llama3-70b": dict(vocab_size=128256, hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672,
                       max_seq_len=8192, rope_theta=500000.0),
}


def preset_names() -> list:
    return list(PRESETS)


def preset_fields(name: str) -> dict:
    """The ModelConfig fields of preset ``name`` (a fresh dict). KeyError if unknown."""
    return dict(PRESETS[name])
