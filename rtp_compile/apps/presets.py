"""Published model shapes to plan on the meta device (never materialised): Llama 2 7B, 13B and
70B (grouped-query attention with 8 key/value heads), as transformers configurations."""

from __future__ import annotations

import torch
from torch import nn

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


def meta_model(name: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The preset `name` built on the meta device in `dtype`: shapes only, no memory."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        raise ImportError(
            f"rtp_compile: the {name} preset needs transformers (pip install transformers)"
        ) from err
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **LLAMA[name])
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(dtype)
