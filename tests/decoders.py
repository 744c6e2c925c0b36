"""Decoders written the way model libraries outside transformers write them (torchtitan-style
Llama, GPT-NeoX-style), with the habits that trip a compiler up:

- RMSNorm that casts its weight (`self.weight.to(x.dtype)`, `.float()`), Gemma's `1 + weight`,
  a layer scale read through `.view(1, 1, -1)`;
- rotary tables and a causal mask computed once per forward and shared by every layer;
- a fused qkv projection whose state_dict holds three keys (`wq`/`wk`/`wv`) through
  state-dict hooks, as checkpoints converted between libraries do.

Sizes are small and uneven (heads that 3 does not divide, widths that 2-4 do not all divide).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DecoderConfig:
    vocab: int = 29
    dim: int = 24
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 40
    max_len: int = 16
    norm: str = "cast"  # "cast": weight.to(x.dtype); "float": weight.float(); "gemma": 1 + w


class CastRMSNorm(nn.Module):
    """RMSNorm computed in float32 with its weight cast, as torchtitan / Meta's llama write it."""

    def __init__(self, dim: int, style: str = "cast", eps: float = 1e-6):
        super().__init__()
        self.style, self.eps = style, eps
        init = torch.zeros(dim) if style == "gemma" else torch.ones(dim)
        self.weight = nn.Parameter(init + 0.1 * torch.randn(dim))

    def forward(self, x):
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        if self.style == "float":
            return (h.float() * self.weight.float()).type_as(x)
        if self.style == "gemma":
            return h * (1.0 + self.weight)
        return h * self.weight.to(x.dtype)


def rotary_tables(head_dim: int, length: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of rotary position embedding, [length, head_dim]."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x, cos, sin):
    """Rotary embedding on x [B, H, T, E] with tables [T, E] (rotate-half form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads, self.kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def project(self, x, cos, sin):
        """q, k, v as [B, heads, T, head_dim], q and k rotated; k and v with the kv heads."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.kv, self.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def attend(self, q, k, v, mask):
        """The heads' outputs through wo (kv heads repeated for their q heads)."""
        rep = self.heads // self.kv
        y = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask
        )
        B, _, T, _ = q.shape
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x, cos, sin, mask):
        return self.attend(*self.project(x, cos, sin), mask)


class SwiGLU(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attention_norm = CastRMSNorm(cfg.dim, cfg.norm)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = CastRMSNorm(cfg.dim, cfg.norm)
        self.feed_forward = SwiGLU(cfg)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(cfg.dim))  # layer scale, read as a view

    def forward(self, x, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x)) * self.scale.view(1, 1, -1)


class LlamaStyle(nn.Module):
    """torchtitan-style Llama: rotary tables and the causal mask made once per forward from
    buffers and handed to every layer; untied output head."""

    def __init__(self, cfg: DecoderConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or DecoderConfig()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = CastRMSNorm(cfg.dim, cfg.norm)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_len, torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[:T].to(h.dtype), self.sin[:T].to(h.dtype)
        mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h))


class FusedQKV(nn.Module):
    """One packed qkv projection whose state_dict speaks separate wq / wk / wv (the layout a
    converted checkpoint has), through a state-dict hook and a load pre-hook."""

    def __init__(self, dim: int, q_out: int, kv_out: int):
        super().__init__()
        self.split = (q_out, kv_out, kv_out)
        self.wqkv = nn.Linear(dim, sum(self.split))
        self._register_state_dict_hook(FusedQKV._split_keys)
        self.register_load_state_dict_pre_hook(FusedQKV._join_keys)

    def forward(self, x):
        return self.wqkv(x)

    @staticmethod
    def _split_keys(module, state_dict, prefix, local_metadata):
        for what in ("weight", "bias"):
            packed = state_dict.pop(f"{prefix}wqkv.{what}")
            for name, part in zip(("wq", "wk", "wv"), packed.split(module.split)):
                state_dict[f"{prefix}{name}.{what}"] = part
        return state_dict

    @staticmethod
    def _join_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for what in ("weight", "bias"):
            keys = [f"{prefix}{name}.{what}" for name in ("wq", "wk", "wv")]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}wqkv.{what}"] = torch.cat([state_dict.pop(k) for k in keys])


class NeoXBlock(nn.Module):
    """GPT-NeoX-style: parallel residual (attention and MLP read the same input), LayerNorms,
    packed qkv, rotary on part of each head (rotary_pct)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.rot = self.head_dim // 4 * 2  # rotary on an even part of each head
        self.input_layernorm = nn.LayerNorm(cfg.dim)
        self.post_attention_layernorm = nn.LayerNorm(cfg.dim)
        self.qkv = FusedQKV(cfg.dim, cfg.dim, cfg.dim)
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.dense_h_to_4h = nn.Linear(cfg.dim, cfg.hidden)
        self.dense_4h_to_h = nn.Linear(cfg.hidden, cfg.dim)

    def attention(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = (
            t.view(B, T, self.heads, self.head_dim).transpose(1, 2)
            for t in self.qkv(x).split(self.qkv.split, dim=-1)
        )
        q = torch.cat([rotate(q[..., : self.rot], cos, sin), q[..., self.rot :]], dim=-1)
        k = torch.cat([rotate(k[..., : self.rot], cos, sin), k[..., self.rot :]], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x, cos, sin):
        mlp = self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(self.post_attention_layernorm(x))))
        return x + self.attention(self.input_layernorm(x), cos, sin) + mlp


class NeoXStyle(nn.Module):
    """GPT-NeoX-style decoder with untied embed_in / embed_out and a final LayerNorm."""

    def __init__(self, cfg: DecoderConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or DecoderConfig()
        self.embed_in = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(NeoXBlock(cfg) for _ in range(cfg.n_layers))
        self.final_layer_norm = nn.LayerNorm(cfg.dim)
        self.embed_out = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads // 4 * 2, cfg.max_len, torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        h = self.embed_in(tokens)
        cos, sin = self.cos[:T].to(h.dtype), self.sin[:T].to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.embed_out(self.final_layer_norm(h))


DECODERS = {
    "llama_cast": lambda: LlamaStyle(DecoderConfig(norm="cast")),
    "llama_float": lambda: LlamaStyle(DecoderConfig(norm="float")),
    "llama_gemma": lambda: LlamaStyle(DecoderConfig(norm="gemma")),
    "neox": lambda: NeoXStyle(),
}


def build_decoder(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return DECODERS[name]().double()


def decoder_batch(seed: int, rank: int, step: int = 0, length: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + step)
    return torch.randint(0, DecoderConfig.vocab, (2, length), generator=g)
