"""Models the tests compile, with sizes chosen so most dims are not divisible by 2, 3 or 4."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rtp_compile.apps.models import GPTConfig, TinyGPT


class MLP(nn.Module):
    """Linear layers of uneven width with LayerNorm and RMSNorm between them."""

    def __init__(self, d_in=7, hidden=11, d_out=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden, bias=False)
        self.rms = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        h = F.gelu(self.norm(self.fc1(x)))
        return self.head(self.rms(torch.tanh(self.fc2(h))))


class ConvNet(nn.Module):
    """Conv2d (stride, padding, bias), BatchNorm with running statistics, a row-split-able head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, 3, padding=1)
        self.bn = nn.BatchNorm2d(5)
        self.conv2 = nn.Conv2d(5, 7, 3, stride=2, bias=False)
        self.conv3 = nn.Conv1d(7, 6, 2)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.conv1(x)))
        h = self.conv2(h).flatten(2)  # [B, 7, L]
        h = self.conv3(h).mean(-1)
        return self.fc(h)


class NoRuleOps(nn.Module):
    """Parameters used by ops without a shard rule: einsum, bmm, a parameter-only chain, a
    scalar, a class token expanded over the batch. Exercises the gather fallback."""

    def __init__(self, d=6):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(d, d) / d)
        self.batch_w = nn.Parameter(torch.randn(1, d, d) / d)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.proj = nn.Linear(d, 3)

    def forward(self, x):  # x: [B, T, d]
        h = torch.einsum("btd,de->bte", x, self.mix)
        h = torch.bmm(h, self.batch_w.expand(x.size(0), -1, -1))
        h = h * (self.scale * 2)
        h = torch.cat([self.cls.expand(x.size(0), -1, -1), h], dim=1)
        return self.proj(torch.tanh(h))


class SharedLayer(nn.Module):
    """One Linear called twice, and a Linear whose weight is transposed explicitly."""

    def __init__(self, d=9):
        super().__init__()
        self.block = nn.Linear(d, d)
        self.back = nn.Parameter(torch.randn(d, 4) / 3)

    def forward(self, x):
        h = torch.tanh(self.block(x))
        h = torch.tanh(self.block(h))
        return h @ self.back  # matmul by a parameter stored [in, out]


class TiedHeadWithBias(nn.Module):
    """An embedding tied to an output layer that has a bias: the layer is row-split (its weight
    is cut along in-features to match the embedding), the bias added once, in its slot."""

    def __init__(self, vocab=11, d=7):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mid(self.emb(idx))))


def _square(t, n):
    """t[:n, :n], spelled so torch.fx can trace it with a traced n."""
    return t.narrow(0, 0, n).narrow(1, 0, n)


class HandAttention(nn.Module):
    """Hand-written pre-norm attention layers with separate q/k/v nn.Linear (head counts that
    2, 3 and 4 ranks do not divide): 3 heads through F.scaled_dot_product_attention with a mask
    buffer; grouped kv heads (4 q, 2 kv, enable_gqa); 3 heads through matmul / softmax / matmul
    with a per-head (ALiBi-style) bias from buffers, heads merged by flatten. Heads are split
    with int sizes, so torch.fx capture sees them too."""

    def __init__(self, d=10, block=8):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(3))
        self.shapes = [(3, 3, 4), (4, 2, 3), (3, 3, 4)]  # (q heads, kv heads, head dim)
        self.q = nn.ModuleList(nn.Linear(d, h * e) for h, _, e in self.shapes)
        self.k = nn.ModuleList(nn.Linear(d, kv * e) for _, kv, e in self.shapes)
        self.v = nn.ModuleList(nn.Linear(d, kv * e, bias=False) for _, kv, e in self.shapes)
        self.o = nn.ModuleList(nn.Linear(h * e, d) for h, _, e in self.shapes)
        self.register_buffer("mask", torch.tril(torch.ones(block, block, dtype=torch.bool)))
        pos = torch.arange(block)
        self.register_buffer("dist", (pos[None, :] - pos[:, None]).clamp(max=0).double())
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125]).view(1, 3, 1, 1))
        self.head = nn.Linear(d, 3)

    def attend(self, i, x):
        B, T, _ = x.shape
        h, kv, e = self.shapes[i]
        q = self.q[i](x).view(B, T, h, e).transpose(1, 2)
        k = self.k[i](x).view(B, T, kv, e).transpose(1, 2)
        v = self.v[i](x).view(B, T, kv, e).transpose(1, 2)
        if i == 0:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=_square(self.mask, T))
        elif i == 1:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            bias = _square(self.dist, T) * self.slopes  # [1, heads, T, T]: a slope per head
            att = torch.softmax(q @ k.transpose(-2, -1) * e**-0.5 + bias, dim=-1)
            return self.o[i]((att @ v).transpose(1, 2).flatten(-2))
        return self.o[i](y.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x):
        for i, norm in enumerate(self.norms):
            x = x + self.attend(i, norm(x))
        return self.head(x)


class FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while `armed` (user code failing mid-backward)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if FailingBackward.armed:
            raise RuntimeError("user code failed in backward")
        return grad


@torch.fx.wrap
def fail_in_backward(x):
    return FailingBackward.apply(x)


class MidBackwardFailure(nn.Module):
    """Units on both sides of a user op whose backward can be made to raise: the units after
    it (in forward order) finish their backward before it raises, the ones before it never run."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 11)
        self.fc2 = nn.Linear(11, 13)
        self.norm = nn.LayerNorm(13)
        self.fc3 = nn.Linear(13, 5)

    def forward(self, x):
        h = fail_in_backward(torch.tanh(self.fc1(x)))
        return self.fc3(self.norm(torch.tanh(self.fc2(h))))


def _rms(h):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class CastNorms(nn.Module):
    """RMSNorm weights and a layer scale read through casts, views that add size-1 dims and
    arithmetic with Python scalars, spelled so torch.fx traces it: `w.to(x.dtype)` and
    `w.type_as(h)` (dtypes known only at run time), `w.double()`, Gemma's `1.0 + w`, `-w / 2`,
    `s.view(1, 1, -1)` and `b[None, None, :]`. (No float32 step: a weight gradient summed in
    float32 over a shard's columns rounds differently from one summed over all of them.)"""

    def __init__(self, d=7, hidden=11, d_out=5):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        (
            self.w_to,
            self.w_type_as,
            self.w_double,
            self.w_gemma,
            self.w_neg,
            self.scale,
            self.shift,
        ) = (nn.Parameter(1 + 0.1 * torch.randn(hidden)) for _ in range(7))
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):  # x: [B, T, d]
        h = _rms(self.fc(x)) * self.w_to.to(x.dtype)
        h = _rms(h) * self.w_type_as.type_as(h)
        h = (_rms(h) * self.w_double.double()).type_as(x)
        h = _rms(h) * (1.0 + self.w_gemma) * (-self.w_neg / 2)
        h = torch.tanh(h) * self.scale.view(1, 1, -1) + self.shift[None, None, :]
        return self.head(h)


class CheckpointedBlocks(nn.Module):
    """Pre-norm MLP blocks with residuals (uneven widths), each run under
    torch.utils.checkpoint.checkpoint(..., use_reentrant=False) when `checkpointed`."""

    def __init__(self, d=10, hidden=23, blocks=3, checkpointed=True):
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
            for _ in range(blocks)
        )
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + (
                torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                if self.checkpointed
                else block(x)
            )
        return self.head(x)


def tiny_gpt():
    return TinyGPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10))


# name -> (factory, make a batch from a generator, supports fx capture)
def _tokens(g):
    return torch.randint(0, 37, (2, 8), generator=g)


ZOO = {
    "mlp": (MLP, lambda g: torch.randn(4, 3, 7, generator=g, dtype=torch.float64)),
    "gpt": (tiny_gpt, _tokens),
    "conv": (ConvNet, lambda g: torch.randn(2, 3, 9, 9, generator=g, dtype=torch.float64)),
    "norule": (NoRuleOps, lambda g: torch.randn(2, 4, 6, generator=g, dtype=torch.float64)),
    "shared": (SharedLayer, lambda g: torch.randn(3, 9, generator=g, dtype=torch.float64)),
    "tiedbias": (TiedHeadWithBias, lambda g: torch.randint(0, 11, (3, 5), generator=g)),
    "attention": (HandAttention, lambda g: torch.randn(2, 5, 10, generator=g, dtype=torch.float64)),
    "midfail": (
        MidBackwardFailure,
        lambda g: torch.randn(4, 3, 7, generator=g, dtype=torch.float64),
    ),
    "checkpointed": (
        CheckpointedBlocks,
        lambda g: torch.randn(4, 5, 10, generator=g, dtype=torch.float64),
    ),
    "castnorms": (CastNorms, lambda g: torch.randn(2, 5, 7, generator=g, dtype=torch.float64)),
}


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return ZOO[name][0]().double()


def batch(name: str, seed: int, rank: int, step: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + step)
    return ZOO[name][1](g)
