"""Published model shapes to plan on the meta device (never materialised), as transformers
configurations: Llama 2 7B, 13B and 70B (`llama-7b`, ...; 70B with grouped-query attention,
8 key/value heads) and Llama 3.1 8B, 70B and 405B (`llama-3.1-8b`, ...: 8 key/value heads,
a 128256-token vocabulary, rope theta 500000)."""

from __future__ import annotations

import torch
from torch import nn

LLAMA_2 = dict(vocab_size=32000, max_position_embeddings=4096)
LLAMA = {
    "llama-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
    ),
    "llama-13b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
    ),
    "llama-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
}
LLAMA_3_1 = dict(
    vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5
)
LLAMA.update(
    {
        "llama-3.1-8b": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            **LLAMA_3_1,
        ),
        "llama-3.1-70b": dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            **LLAMA_3_1,
        ),
        "llama-3.1-405b": dict(
            hidden_size=16384,
            intermediate_size=53248,
            num_hidden_layers=126,
            num_attention_heads=128,
            num_key_value_heads=8,
            **LLAMA_3_1,
        ),
    }
)


def meta_model(name: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The preset `name` built on the meta device in `dtype`: shapes only, no memory."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        raise ImportError(
            f"rtp_compile: the {name} preset needs transformers (pip install transformers)"
        ) from err
    config = LlamaConfig(**{**LLAMA_2, **LLAMA[name]})
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(dtype)
