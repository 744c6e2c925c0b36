"""Norm weights and layer scales read through a chain (issue 13): a dtype cast, a view that adds
or drops size-1 dims, arithmetic with a Python scalar. The elementwise op still rotates (or,
small, is gathered once per step) and applies the chain to each shard; a chain a shard cannot
go through stays gathered, with the reason. The rule's steps themselves are checked shard by
shard against autograd in tests/test_passes.py (RULE_CASES with chains)."""

import pytest
import torch
from jobs import decoder_parity
from torch import nn

import rtp_compile

# name -> the op of activation h (from input x) and parameter w; one weight per chain kind
CHAINS = {
    "to": lambda h, w, x: h * w.to(x.dtype),
    "float": lambda h, w, x: (h.float() * w.float()).type_as(x),
    "type_as": lambda h, w, x: h * w.type_as(h),
    "gemma": lambda h, w, x: h * (1.0 + w),
    "scalar": lambda h, w, x: h * (-w * 0.5),
    "view": lambda h, w, x: h * w.view(1, 1, -1),
    "index": lambda h, w, x: h + w[None, None, :],
    "unsqueeze": lambda h, w, x: h * w.unsqueeze(0).double(),
}


class Chains(nn.Module):
    """A linear layer, then one RMSNorm-like weight per chain kind of CHAINS."""

    def __init__(self, d=6, hidden=11):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.w = nn.ParameterDict(
            {f"w_{k}": nn.Parameter(1 + 0.1 * torch.randn(hidden)) for k in CHAINS}
        )

    def forward(self, x):
        h = self.fc(x)
        for kind, op in CHAINS.items():
            h = op(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), self.w[f"w_{kind}"], x)
        return h


def _compile(model, capture, **options):
    example = (torch.randn(2, 3, 6, dtype=torch.float64),) if capture == "export" else None
    return rtp_compile.transform(model, 3, example_inputs=example, **options)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_every_chain_kind_rotates_or_is_small(capture):
    model = Chains().double()
    rotated = _compile(model, capture, small_param_bytes=0)
    small = _compile(model, capture)
    for kind in CHAINS:
        name = f"w.w_{kind}"
        (unit,) = rotated.plan.units_of(name)
        assert (unit.kind, unit.call.rule.name, rotated.plan.params[name].dim) == (
            "rotate",
            "elementwise",
            0,
        ), (kind, unit.reason)
        assert [u.kind for u in small.plan.units_of(name)] == ["small"], kind
    assert rotated.report().count(": elementwise dim0 ") == len(CHAINS), rotated.report()
    assert "  gathered " not in rotated.report() + small.report()
    assert small.report().count("  small ") == len(CHAINS), small.report()


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_the_rank_code_applies_the_chain_to_each_shard(capture):
    """Each step's shard goes through the chain in the emitted code; a dtype read at run time
    (x.dtype, type_as(h)) is passed to the unit, not fixed at compile time."""
    prog = _compile(Chains().double(), capture, small_param_bytes=0)
    code = prog.module(0).code
    # hidden 11 on 3 ranks: shards of 4, 4 and 3; the views add size-1 dims to each
    for view in ("reshape((1, 1, 4))", "reshape((1, 1, 3))", "reshape((1, 4))", "reshape((1, 3))"):
        assert view in code, view
    assert ".to(getattr_" in code  # w.to(x.dtype) or w.type_as(h): the dtype comes in at run time
    cast = {"fx": "float()", "export": "aten.to.dtype("}[capture]
    scalar = {"fx": "1.0 + ", "export": "aten.add.Tensor("}[capture]
    assert cast in code and scalar in code, code


UNSHARDABLE = {  # op of activation h [2, 3, 8] and parameter w [8] -> words of the reason
    "sum": (lambda h, w: h * w.sum(), "through sum"),
    "matmul": (lambda h, w: h * (w @ w), "through matmul"),
    "strided": (lambda h, w: h[..., ::2] * w[::2], "from (8,); a shard can only gain or lose"),
    "regroup": (lambda h, w: h.view(2, 3, 2, 4) * w.view(2, 4), "(2, 4) from (8,)"),
    "expand": (lambda h, w: h * w.expand(2, 3, 8), "through expand"),
}


class OneOp(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op, self.w = op, nn.Parameter(torch.randn(8))

    def forward(self, h):
        return self.op(h, self.w)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("case", list(UNSHARDABLE))
def test_a_chain_a_shard_cannot_go_through_stays_gathered_with_the_reason(case, capture):
    op, words = UNSHARDABLE[case]
    example = (torch.randn(2, 3, 8, dtype=torch.float64),) if capture == "export" else None
    prog = rtp_compile.transform(OneOp(op).double(), 2, example_inputs=example)
    (unit,) = prog.plan.units
    assert unit.kind == "gather", unit
    assert words in unit.reason, unit.reason
    assert f"because {unit.reason}" in prog.report()


CASES = [
    (name, options)
    for name in ("llama_cast", "llama_float", "llama_gemma", "castnorms")
    for options in ({}, {"small_param_bytes": 0})
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3])
def test_casted_norms_train_like_ddp(world_size, seed):
    """The three Llama norms (exported) and tests/zoo.py's CastNorms (fx, dtypes known only at
    run time): outputs equal the unsharded model's, gradients and two AdamW steps DDP's, with
    the norm weights and layer scales small (default) or rotated (small_param_bytes=0), none
    gathered. llama_float's weight gradients are summed in float32 over a shard's 12 or 8
    columns, which this CPU's kernels sum in the same order as over all 24 (narrower shards
    would hold it to float32 accuracy, as HF Llama is in test_transformers.py)."""
    results = rtp_compile.launch(decoder_parity, world_size, args=(CASES, seed), timeout=500)
    for rank, per_case in enumerate(results):
        for name, options in CASES:
            key = (name, tuple(sorted(options.items())))
            for what, err in per_case[key].items():
                assert err <= 1e-9, f"rank {rank} {name} {options}: {what} rel. error {err:.2e}"
            kinds, report = per_case[key + ("kinds",)], per_case[key + ("report",)]
            assert all("gather" not in k for k in kinds.values()), report
            elementwise = {
                p: k
                for p, k in kinds.items()
                if p.endswith(("norm.weight", "scale", "shift")) or p.startswith("w_")
            }
            assert len(elementwise) == 7, kinds
            kind = "rotate" if options else "small"
            assert all(k == [kind] for k in elementwise.values()), report
