"""Small built-in models: the GPT-style decoder the demo trains and the notebooks inspect."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # [B, T, C] -> [B, H, T, C/H]; unflatten keeps the model traceable by torch.fx
        q, k, v = (t.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-2-style decoder: token + position embeddings, pre-norm blocks, tied LM head."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation: normal(0, 0.02) weights, zero biases (first loss ~ ln vocab)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def generate(
    model: TinyGPT, prompt: torch.Tensor, n_new: int, *, temperature: float = 0.8, seed: int = 0
) -> torch.Tensor:
    """Continue the token ids `prompt` [T] by `n_new` tokens sampled from `model` (an unsharded
    TinyGPT), reading at most its last `block_size` tokens; `temperature` 0 is greedy. Sampled
    with a generator seeded by `seed`: the same model, prompt and seed give the same text.
    Returns prompt and continuation, [T + n_new]."""
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    ids = prompt.clone()
    for _ in range(n_new):
        logits = model(ids[-model.cfg.block_size :].unsqueeze(0))[0, -1]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        else:
            nxt = logits.argmax().unsqueeze(0)
        ids = torch.cat([ids, nxt])
    model.train(was_training)
    return ids


def lm_step(rank: int, world_size: int, prog, vocab_size: int, batch_size: int, seq_len: int):
    """A `make_step`: one AdamW step of rank `rank`'s module of `prog` (a language model on
    token ids, next-token loss) on its own random batch of `batch_size` x `seq_len` tokens."""
    gm = prog.module(rank)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)

    def step() -> float:
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
        loss = lm_loss(gm(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step
