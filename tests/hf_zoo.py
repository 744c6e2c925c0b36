"""Small transformers models (random init from a config, never downloaded weights), with batches.

Dropout is zero so sharded and unsharded runs compute the same function.
"""

from __future__ import annotations

import torch
from torch import nn


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            n_embd=12,
            n_layer=2,
            n_head=2,
            vocab_size=53,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=53,
            max_position_embeddings=32,
        )
    )


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            hidden_size=12,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=2,
            vocab_size=53,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            d_model=12,
            d_ff=22,
            d_kv=6,
            num_layers=2,
            num_heads=2,
            vocab_size=53,
            decoder_start_token_id=0,
            dropout_rate=0.0,
        )
    )


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(
            hidden_size=12,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            hidden_size=16,
            intermediate_size=22,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=53,
            num_local_experts=3,
            num_experts_per_tok=2,
            max_position_embeddings=32,
            experts_implementation="batched_mm",
        )
    )


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(
            hidden_size=16,
            ffn_dim=22,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=53,
            max_position_embeddings=32,
            word_embed_proj_dim=16,
            dropout=0.0,
            attention_dropout=0.0,
        )
    )


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            hidden_size=16,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=53,
            max_position_embeddings=32,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    )


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=16,
            intermediate_size=22,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=53,
            max_position_embeddings=32,
        )
    )


class TorchEncoder(nn.Module):
    """nn.TransformerEncoder: fused nn.MultiheadAttention with a packed in_proj_weight."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(10, 2, 18, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(10, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def _tokens(g, vocab=53, shape=(2, 7)):
    return torch.randint(0, vocab, shape, generator=g)


# name -> (factory, inputs from a generator, dtype, pass example inputs explicitly)
HF_ZOO = {
    "gpt2": (_gpt2, lambda g: {"input_ids": _tokens(g)}, torch.float64, False),
    "llama": (_llama, lambda g: {"input_ids": _tokens(g)}, torch.float64, False),
    "bert": (_bert, lambda g: {"input_ids": _tokens(g)}, torch.float64, False),
    "t5": (
        _t5,
        lambda g: {"input_ids": _tokens(g), "decoder_input_ids": _tokens(g, 53, (2, 5))},
        torch.float64,
        True,
    ),
    "vit": (
        _vit,
        lambda g: {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)},
        torch.float64,
        True,
    ),
    "mixtral": (_mixtral, lambda g: {"input_ids": _tokens(g)}, torch.float64, False),
    "opt": (_opt, lambda g: {"input_ids": _tokens(g)}, torch.float64, False),
    "neox": (_neox, lambda g: {"input_ids": _tokens(g)}, torch.float64, False),
    "qwen2": (_qwen2, lambda g: {"input_ids": _tokens(g)}, torch.float64, False),
    "torch_encoder": (
        TorchEncoder,
        lambda g: {"x": torch.randn(2, 5, 10, generator=g)},
        torch.float64,
        True,
    ),
}


def build_hf(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return HF_ZOO[name][0]().to(HF_ZOO[name][2])


def hf_batch(name: str, seed: int, rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + step)
    dtype = HF_ZOO[name][2]
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in HF_ZOO[name][1](g).items()}


def logits_of(out):
    """The tensor a loss is taken on: .logits of a ModelOutput, or the output itself."""
    return out.logits if hasattr(out, "logits") else out
