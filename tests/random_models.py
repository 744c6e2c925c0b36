"""Random models for the property-based tests: a spec (plain data, so it travels to the ranks)
drawn by hypothesis, and the model it describes.

A spec is a stack of layers over [batch, length, width] activations: linear (with or without
bias), a conv over the length, norms (LayerNorm, RMSNorm, RMSNorm that casts its weight, Gemma's
1 + w, a layer scale read through a view), activations, an MLP block, a small attention block
(separate q/k/v, causal), one linear called twice (a tied use), and a linear whose state_dict
key is renamed by state-dict hooks. Widths include 1 and primes. Optionally tokens in through an
embedding and logits out through a head tied to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from decoders import CastRMSNorm
from hypothesis import strategies as st
from torch import nn

WIDTHS = st.sampled_from([1, 2, 3, 5, 6, 7, 11, 13])

LAYERS = st.one_of(
    st.tuples(st.just("linear"), WIDTHS, st.booleans()),
    st.tuples(st.just("conv"), WIDTHS, st.sampled_from([1, 3])),
    st.tuples(
        st.just("norm"), st.sampled_from(["layer", "rms", "cast", "float", "gemma", "scale"])
    ),
    st.tuples(st.just("act"), st.sampled_from(["gelu", "tanh"])),
    st.tuples(st.just("mlp"), WIDTHS),
    st.tuples(st.just("attention"), st.integers(1, 4), st.integers(1, 3)),
    st.tuples(
        st.just("twice"),
    ),
    st.tuples(st.just("hooked"), WIDTHS),
)


@st.composite
def model_specs(draw) -> dict:
    """A random model: its layers, input width, tokens in (vocab) or not, a tied head. It has
    parameters (DDP, the reference, refuses a model without), and norms with statistics only
    see widths >= 2 (over one element a norm's output is its bias whatever the input, and its
    weight's gradient, zero in exact arithmetic, is rounding noise in every implementation)."""
    vocab = draw(st.one_of(st.none(), st.sampled_from([2, 5, 11])))
    width = draw(WIDTHS)
    layers, d = [], width
    for kind, *args in draw(st.lists(LAYERS, min_size=1, max_size=5)):
        if kind == "norm" and args[0] != "scale" and d == 1:
            args = ["scale"]
        layers.append((kind, *args))
        d = args[0] if kind in ("linear", "conv", "hooked") else d
    if vocab is None and all(kind == "act" for kind, *_ in layers):
        layers.append(("linear", draw(WIDTHS), True))
    return {
        "width": width,
        "vocab": vocab,
        "layers": layers,
        "tied_head": vocab is not None and draw(st.booleans()),
        "capture": draw(st.sampled_from(["fx", "export"])),
    }


class LayerScale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return x * self.gamma.view(1, 1, -1)


class Conv(nn.Module):
    """A conv over the length of [B, T, C] (same padding)."""

    def __init__(self, d, out, k):
        super().__init__()
        self.conv = nn.Conv1d(d, out, k, padding=k // 2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    def __init__(self, d, heads, head_dim):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q, self.k, self.v = (nn.Linear(d, heads * head_dim) for _ in range(3))
        self.o = nn.Linear(heads * head_dim, d)

    def forward(self, x):  # sizes by unflatten / flatten: torch.fx traces it too
        q, k, v = (
            p(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).flatten(-2))


class Twice(nn.Module):
    """One linear called twice: its weight has two uses."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class Hooked(nn.Module):
    """A linear whose state_dict says `proj_w` / `proj_b` (hooks rename both ways)."""

    def __init__(self, d, out):
        super().__init__()
        self.inner = nn.Linear(d, out)
        self._register_state_dict_hook(Hooked._rename)
        self.register_load_state_dict_pre_hook(Hooked._rename_back)

    def forward(self, x):
        return self.inner(x)

    @staticmethod
    def _rename(module, state_dict, prefix, local_metadata):
        state_dict[f"{prefix}proj_w"] = state_dict.pop(f"{prefix}inner.weight")
        state_dict[f"{prefix}proj_b"] = state_dict.pop(f"{prefix}inner.bias")

    @staticmethod
    def _rename_back(module, state_dict, prefix, *args):
        for new, old in (("proj_w", "inner.weight"), ("proj_b", "inner.bias")):
            if f"{prefix}{new}" in state_dict:
                state_dict[f"{prefix}{old}"] = state_dict.pop(f"{prefix}{new}")


def _layer(kind, d, args):
    """(module, output width) of one spec layer on width d."""
    if kind == "linear":
        return nn.Linear(d, args[0], bias=args[1]), args[0]
    if kind == "conv":
        return Conv(d, *args), args[0]
    if kind == "norm":
        style = args[0]
        if style == "layer":
            return nn.LayerNorm(d), d
        if style == "rms":
            return nn.RMSNorm(d), d
        if style == "scale":
            return LayerScale(d), d
        return CastRMSNorm(d, style), d
    if kind == "act":
        return (nn.GELU() if args[0] == "gelu" else nn.Tanh()), d
    if kind == "mlp":
        return MLP(d, args[0]), d
    if kind == "attention":
        return Attention(d, *args), d
    if kind == "twice":
        return Twice(d), d
    return Hooked(d, args[0]), args[0]


class RandomModel(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        d = spec["width"]
        self.embed = nn.Embedding(spec["vocab"], d) if spec["vocab"] else None
        layers = []
        for kind, *args in spec["layers"]:
            layer, d = _layer(kind, d, args)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.head = None
        if spec["vocab"]:
            self.head = nn.Linear(d, spec["vocab"], bias=False)
            if spec["tied_head"] and d == spec["width"]:
                self.head.weight = self.embed.weight

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x if self.head is None else self.head(x)


def build_random(spec: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return RandomModel(spec).double()


def random_batch(spec: dict, seed: int, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + step)
    if spec["vocab"]:
        return torch.randint(0, spec["vocab"], (2, 5), generator=g)
    return torch.randn(2, 5, spec["width"], generator=g, dtype=torch.float64)
