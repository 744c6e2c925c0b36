"""Each pass on small graphs, in one process: the invariant its docstring states."""

import operator

import pytest
import torch
from torch import nn
from zoo import build, tiny_gpt

import rtp_compile
from rtp_compile.capture.trace import capture
from rtp_compile.core.ir import unit_of
from rtp_compile.core.layout import ParamLayout
from rtp_compile.core.op_rules import RULES, ChainOp, RunInput
from rtp_compile.passes.analysis.match import match_op, parameter_reads
from rtp_compile.passes.lower_modules import lower_modules
from rtp_compile.passes.manager.context import Context, Options
from rtp_compile.passes.split_norm_affine import split_norm_affine


@pytest.fixture(autouse=True)
def float64_by_default():
    """This module's small models are float64 (exact comparisons), and only this module's:
    the default dtype is restored after each test."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.mark.parametrize(
    "shape,dim", [((10, 6), 0), ((10, 6), 1), ((5,), 0), ((3, 1, 7), 2), ((2, 3), None), ((), None)]
)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_layout_shards_cover_the_tensor_once_with_zero_padding(shape, dim, world_size):
    full = torch.randn(shape)
    layout = ParamLayout("p", shape, full.dtype, world_size, dim)
    shards = [layout.shard(full, s) for s in range(world_size)]
    assert all(tuple(s.shape) == layout.shard_shape for s in shards)
    assert torch.equal(layout.unshard(shards), full)
    real = sum(layout.slot(s).valid for s in range(world_size))
    assert real == layout.extent
    padding = sum(s.numel() for s in shards) - full.numel()
    assert sum(s.abs().sum() for s in shards) == pytest.approx(full.abs().sum().item())
    assert padding >= 0


def _plan(model, world_size=3, **kw):
    return rtp_compile.transform(model, world_size, **kw).plan


def test_tied_embedding_and_head_share_one_layout():
    plan = _plan(tiny_gpt())
    assert plan.params["wte.weight"].dim == 1
    uses = {u.call.rule.name: u.mode for u in plan.units_of("wte.weight")}
    assert uses == {"embedding": "col", "linear": "row"}
    assert plan.params["wte.weight"].aliases == ("wte.weight", "lm_head.weight")


def test_every_parameter_is_rotated_or_gathered_with_a_reason():
    plan = _plan(build("norule", 0))
    strategies = {n: plan.strategy(n) for n in plan.params}
    assert strategies == {
        "mix": "gather",
        "batch_w": "gather",
        "scale": "gather",
        "cls": "gather",
        "proj.weight": "rotate",
        "proj.bias": "rotate",
    }
    reasons = {u.target: u.reason for u in plan.units if u.kind == "gather"}
    assert reasons["einsum"] == "no shard rule for einsum"
    assert reasons["expand"] == "no shard rule for expand"  # batch_w and cls, expanded by B
    # h * (scale * 2): the chain is seen through, but a 0-d scale scales all of h
    assert "scale has no dim larger than 1" in reasons["mul"]
    assert plan.params["mix"].dim is None  # gathered only: cut flat, evenly


def test_gather_reasons_say_what_to_do():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.grouped = nn.Conv2d(4, 4, 3, groups=2)
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

        def forward(self, x):
            h = self.grouped(x).flatten(2).transpose(1, 2)
            return self.attn(h, h, h)[0]

    reasons = [u.reason for u in _plan(Odd()).units]
    assert "groups=2" in reasons[0]
    assert "MultiheadAttention is called as one module" in reasons[1]
    assert "example_inputs" in reasons[1]


def test_parameter_metadata_reads_need_no_gather():
    class ShapeUser(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x):
            return (
                self.fc(x) * self.fc.weight.shape[0] + self.fc.weight.size(1) + self.fc.weight.dim()
            )

    model = ShapeUser()
    prog = rtp_compile.transform(model, 2)
    assert [u.kind for u in prog.plan.units] == ["rotate"]
    x = torch.randn(3, 4)
    one = rtp_compile.transform(model, 1).module(0)
    assert torch.allclose(one(x), model(x))


def test_unused_parameter_is_still_sharded():
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.spare = nn.Parameter(torch.randn(9))

        def forward(self, x):
            return self.fc(x)

    prog = rtp_compile.transform(WithSpare(), 3)
    assert prog.plan.strategy("spare") == "unused"
    assert tuple(prog.module(0).get_parameter("spare").shape) == (3,)
    assert "unused parameters" in prog.report()


def test_lower_modules_and_split_norms_keep_the_computation():
    class Norms(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
            self.bn = nn.BatchNorm2d(4)
            self.gn = nn.GroupNorm(2, 4)
            self.ln = nn.LayerNorm([4, 5, 5])
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.ln(self.gn(self.bn(self.conv(x)))))

    model = Norms()
    captured = capture(model)
    gm, ctx = captured.gm, Context.of(captured, 1, Options())
    lower_modules(gm, ctx)
    split_norm_affine(gm, ctx)
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    x = torch.randn(2, 3, 5, 5)
    model.eval(), gm.eval()  # eval: dropout off, running statistics used
    assert torch.allclose(gm(x), model(x), atol=1e-12)
    model.train(), gm.train()
    torch.manual_seed(0)
    y = gm(x)
    torch.manual_seed(0)
    assert torch.allclose(y, model(x), atol=1e-12)
    assert torch.equal(gm.bn.running_mean, model.bn.running_mean)


def test_adapters_agree_across_capture_levels():
    model = build("mlp", 0)
    x = torch.randn(2, 7)
    for level, example in (("function", None), ("aten", (x,))):
        captured = capture(model, example)
        gm, ctx = captured.gm, Context.of(captured, 1, Options())
        lower_modules(gm, ctx)  # function level only
        split_norm_affine(gm, ctx)
        reads = parameter_reads(gm)
        calls = [match_op(n, gm, reads) for n in gm.graph.nodes]
        seen = sorted((c.rule.name, tuple(sorted(c.params.values()))) for c in calls if c)
        assert seen == sorted(
            [
                ("linear", ("fc1.bias", "fc1.weight")),
                ("elementwise", ("norm.bias", "norm.weight")),
                ("linear", ("fc2.weight",)),
                ("elementwise", ("rms.weight",)),
                ("linear", ("head.bias", "head.weight")),
            ]
        ), level


def test_after_rotate_only_units_read_parameters():
    for name in ("gpt", "norule", "shared", "conv", "mlp"):
        prog = rtp_compile.transform(build(name, 0), 2)
        params = set(prog.plan.params)
        units = {u.name for u in prog.plan.units}
        for node in prog.graph.nodes:
            if node.op == "get_attr" and node.target in params:
                assert all(unit_of(u) in units for u in node.users), node


RULE_CASES = [
    # rule, options, params {role: shape}, input shape, op computing the full result
    (
        "linear",
        {"transposed": False},
        {"weight": (10, 6), "bias": (10,)},
        (2, 3, 6),
        lambda x, p: torch.nn.functional.linear(x, p["weight"], p["bias"]),
    ),
    ("linear", {"transposed": True}, {"weight": (6, 10)}, (4, 6), lambda x, p: x @ p["weight"]),
    (
        "conv",
        {
            "stride": [2, 1],
            "padding": [1, 0],
            "dilation": [1, 2],
            "transposed": False,
            "output_padding": [0, 0],
        },
        {"weight": (5, 3, 3, 2), "bias": (5,)},
        (2, 3, 7, 6),
        lambda x, p: torch.conv2d(x, p["weight"], p["bias"], [2, 1], [1, 0], [1, 2]),
    ),
    (
        "conv",
        {"stride": [2], "padding": [1], "dilation": [1], "transposed": True, "output_padding": [1]},
        {"weight": (3, 5, 3), "bias": (5,)},
        (2, 3, 6),
        lambda x, p: torch.conv_transpose1d(x, p["weight"], p["bias"], 2, 1, 1),
    ),
    (
        "embedding",
        {"padding_idx": 2, "scale_grad_by_freq": True},
        {"weight": (9, 7)},
        (3, 5),
        lambda x, p: torch.nn.functional.embedding(x, p["weight"], 2, scale_grad_by_freq=True),
    ),
    (
        "elementwise",
        {"dim": -1},
        {"weight": (3, 7), "bias": (3, 7)},
        (2, 3, 7),
        lambda x, p: x * p["weight"] + p["bias"],
    ),
    (
        "elementwise",
        {"dim": 1},
        {"weight": (5,), "bias": (5,)},
        (2, 5, 3, 3),
        lambda x, p: x * p["weight"].view(5, 1, 1) + p["bias"].view(5, 1, 1),
    ),
    # parameters read through a chain (tests/test_casted_weights.py): a view adding size-1
    # dims, casts (one to a dtype given at run time), scalar arithmetic on either side
    (
        "elementwise",
        {
            "dim": -1,
            "shape": (1, 7, 1, 3),
            "chains": {
                "weight": (
                    ChainOp(torch.ops.aten.to.dtype, 0, (torch.float32,)),
                    ChainOp(operator.sub, 1, (1.0,)),
                )
            },
        },
        {"weight": (7, 3)},
        (2, 7, 4, 3),
        lambda x, p: x * (1.0 - p["weight"].float().view(1, 7, 1, 3)),
    ),
    (
        "elementwise",
        {
            "dim": -1,
            "run_inputs": (torch.float64,),
            "chains": {
                "weight": (ChainOp("to", 0, (RunInput(0),)),),
                "bias": (ChainOp("mul", 0, (-0.5,)),),
            },
        },
        {"weight": (3, 7), "bias": (3, 7)},
        (2, 3, 7),
        lambda x, p: x * p["weight"] - p["bias"] / 2,
    ),
]


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rule_steps_reassemble_the_op_and_its_gradients(case, world_size):
    """All N steps of one rank, shards taken locally: outputs combine to the full op; the step
    backwards add up to autograd's gradients. Every mode of the rule, every rank's step order."""
    rule_name, options, shapes, x_shape, full_op = case
    rule = RULES[rule_name]
    params = {r: torch.randn(s, requires_grad=True) for r, s in shapes.items()}
    x = (
        torch.randint(0, 9, x_shape)
        if rule_name == "embedding"
        else torch.randn(x_shape, requires_grad=True)
    )
    y = full_op(x, params)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [*params.values()] + ([x] if x.is_floating_point() else []), dy)
    for mode, dims in rule.modes(shapes, options).items():
        layouts = {r: ParamLayout(r, shapes[r], torch.float64, world_size, dims[r]) for r in shapes}
        shards = {
            r: [lay.shard(params[r].detach(), s) for s in range(world_size)]
            for r, lay in layouts.items()
        }
        parts = {}
        for s in range(world_size):
            slots = {r: lay.slot(s) for r, lay in layouts.items()}
            part = rule.forward_step(
                mode, options, x.detach(), {r: shards[r][s] for r in shapes}, slots, shapes
            )
            if part is not None:
                parts[s] = part
        combine = rule.combine(mode, options, shapes)
        out = (
            torch.cat([parts[s] for s in sorted(parts)], combine.dim)
            if combine.how == "cat"
            else sum(parts[s] for s in sorted(parts))
        )
        assert torch.allclose(out, y, atol=1e-12), mode
        dx = torch.zeros_like(x) if x.is_floating_point() else None
        acc = {
            r: [torch.zeros(lay.shard_shape) for _ in range(world_size)]
            for r, lay in layouts.items()
        }
        for s in range(world_size):
            slots = {r: lay.slot(s) for r, lay in layouts.items()}
            here = {r: shards[r][s] for r in shapes}
            if dx is not None:
                rule.input_grad(mode, options, dy, x.detach(), here, slots, shapes, dx)
            into = {r: acc[r][s].narrow(layouts[r].dim, 0, slots[r].valid) for r in shapes}
            rule.weight_grads(mode, options, dy, x.detach(), here, slots, shapes, into)
        for (r, lay), g in zip(layouts.items(), grads):
            assert torch.allclose(lay.unshard(acc[r]), g, atol=1e-12), (mode, r)
        if dx is not None:
            assert torch.allclose(dx, grads[-1], atol=1e-12), mode


def test_tied_output_layer_with_bias_is_row_split():
    plan = _plan(build("tiedbias", 0))
    (out,) = [u for u in plan.units if u.params.get("bias") == "out.bias"]
    assert out.mode == "row" and plan.params["emb.weight"].dim == 1


def test_ring_ops_have_fake_implementations():
    """Graphs with ring ops trace under FakeTensorMode without any communication."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import rtp_compile.runtime.ring  # noqa: F401
    from rtp_compile.runtime.packing import unpack

    with FakeTensorMode():
        w, b = torch.empty(3, 4), torch.empty(3)
        hop = torch.ops.rtp.ring_shift_start([w, b], "", 1, 0, "fake")
        received = torch.ops.rtp.ring_wait(hop, [w, b])
        views = unpack(received, [((3, 4), torch.float64), ((3,), torch.float64)])
    assert hop.shape == () and hop.dtype == torch.int64
    assert received.shape == (15,) and [v.shape for v in views] == [(3, 4), (3,)]


def test_one_flat_message_per_hop_packs_mixed_dtypes_aligned():
    from rtp_compile.runtime.packing import pack, specs_of, unpack

    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.arange(4)]
    flat = pack(tensors)
    assert flat.dtype == torch.uint8
    views = unpack(flat, specs_of(tensors))
    assert all(torch.equal(v, t) and v.dtype == t.dtype for v, t in zip(views, tensors))
    assert pack(views).data_ptr() == flat.data_ptr()  # what arrived passes on without a copy
    same = [torch.randn(2, 3), torch.randn(3)]
    assert pack(same).dtype == same[0].dtype and pack(same).shape == (9,)


def _kinds(model, **kw):
    return [(u.name, u.kind) for u in _plan(model, **kw).units]


def test_mlp_and_swiglu_blocks_fuse_into_one_unit():
    gpt = _plan(tiny_gpt())
    fused = [u for u in gpt.units if u.kind == "fused"]
    assert [u.name for u in fused] == ["blocks_0_mlp", "blocks_1_mlp"]
    assert gpt.params["blocks.0.mlp.2.weight"].dim == 1  # the tail is cut on its inputs
    assert gpt.params["blocks.0.mlp.0.weight"].dim == 0

    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up = nn.Linear(6, 10, bias=False), nn.Linear(6, 10, bias=False)
            self.down = nn.Linear(10, 6)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    (unit,) = _plan(SwiGLU()).units
    assert unit.kind == "fused" and len(unit.fusion.columns) == 2
    assert set(unit.params.values()) == {"gate.weight", "up.weight", "down.weight", "down.bias"}
    assert all(u.kind != "fused" for u in _plan(tiny_gpt(), fuse=False).units)


def test_blocks_are_not_fused_where_it_would_not_be_exact():
    class Leaky(nn.Module):  # the hidden activation is also read outside the block
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h), h.sum(-1)

    class Mixing(nn.Module):  # softmax mixes the hidden dim
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.b(torch.softmax(self.a(x), -1))

    for model in (Leaky(), Mixing(), build("shared", 0)):
        assert all(kind != "fused" for _, kind in _kinds(model)), type(model).__name__


def test_native_layer_norm_of_decomposed_graphs_is_split_and_rotated():
    """Graphs decomposed below the training IR use aten.native_layer_norm (a tuple)."""

    class Decomposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))

        def forward(self, x):
            out, mean, rstd = torch.ops.aten.native_layer_norm(x, [6], self.weight, self.bias, 1e-5)
            return out * 2 + mean

    model = Decomposed()
    prog = rtp_compile.transform(model, 2, small_param_bytes=0)  # rotated, not gathered per step
    assert [(u.kind, u.call.rule.name) for u in prog.plan.units] == [("rotate", "elementwise")]
    assert [u.kind for u in rtp_compile.transform(model, 2).plan.units] == ["small"]
    x = torch.randn(3, 6)
    assert torch.allclose(rtp_compile.transform(model, 1).module(0)(x), model(x), atol=1e-12)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "shape,dim,granule",
    [((12, 5), 0, 4), ((8, 5), 0, 4), ((5, 16), 1, 8), ((6,), 0, 3), ((12, 5), 0, 12)],
)
def test_layout_granules_hold_whole_heads_with_zero_padding(shape, dim, granule, world_size):
    """Shards of whole granules (3 heads at N=2 or 4, 2 kv heads at N=3: some shard holds none):
    still one cover of the tensor, padding zero and at the end, shard s <-> groups of shard s."""
    full = torch.randn(shape)
    layout = ParamLayout("p", shape, full.dtype, world_size, dim, granule=granule)
    groups = shape[dim] // granule
    shards = [layout.shard(full, s) for s in range(world_size)]
    assert layout.shard_len == -(-groups // world_size) * granule
    assert torch.equal(layout.unshard(shards), full)
    for s, shard in enumerate(shards):
        slot = layout.slot(s)
        assert slot.offset % granule == 0 and slot.valid % granule == 0
        assert torch.equal(shard.narrow(dim, 0, slot.valid), layout.real_part_of(full, s))
        assert not shard.narrow(dim, slot.valid, slot.length - slot.valid).any()
    assert sum(layout.slot(s).valid for s in range(world_size)) == shape[dim]
    with pytest.raises(ValueError, match="granule"):
        ParamLayout(
            "p",
            shape,
            full.dtype,
            world_size,
            dim,
            granule=granule + 1 if granule > 1 else shape[dim] + 1,
        )


def _fused(plan):
    return {u.name: u.fusion for u in plan.units if u.kind == "fused"}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_attention_heads_fuse_through_the_output_projection(world_size, capture):
    """Separate q/k/v -> heads -> SDPA (mask), GQA, or matmul/softmax/matmul with a per-head
    bias -> o_proj: one unit each, cut in whole head groups (a kv head with its q heads)."""
    from zoo import batch

    example = (batch("attention", 0, 0, 0),) if capture == "export" else None
    plan = _plan(build("attention", 0), world_size, example_inputs=example, fuse_padding=1.0)
    fused = _fused(plan)
    assert sorted(fused) == ["o_0", "o_1", "o_2"] and not plan.unfused
    assert all(f.attention for f in fused.values())
    assert [fused[n].groups for n in ("o_0", "o_1", "o_2")] == [3, 2, 3]
    # GQA: 4 q heads of 3 and 2 kv heads of 3 -> a group is 2 q heads (6) and 1 kv head (3)
    assert plan.params["q.1.weight"].granule == 6 and plan.params["k.1.weight"].granule == 3
    assert plan.params["o.1.weight"].dim == 1 and plan.params["o.1.weight"].granule == 6
    for s in range(world_size):  # q shard s holds the q heads of kv shard s's kv heads
        q, k = (plan.params[f"{p}.1.weight"].slot(s) for p in "qk")
        assert q.valid == 2 * k.valid and q.offset == 2 * k.offset
    # the per-head slope bias (a buffer) is cut with the heads; the mask broadcasts over them
    kinds = {r.kind for rs in fused["o_2"].rewrites.values() for r in rs}
    assert kinds >= {"size", "slice" if capture == "export" else "check"}
    assert (
        "o.0" in rtp_compile.transform(build("attention", 0), world_size, fuse_padding=1.0).report()
    )
    # by default memory comes first: only blocks whose groups N divides are fused
    default = _plan(build("attention", 0), world_size, example_inputs=example)
    assert sorted(_fused(default)) == [
        n for n, g in (("o_0", 3), ("o_1", 2), ("o_2", 3)) if g % world_size == 0
    ]
    assert all("fuse_padding allows 2%" in why for why in default.unfused.values())


def test_attention_is_not_fused_where_it_would_not_be_exact():
    """Each reason by rule: packed qkv, a learned per-head bias, attention dropout, softmax over
    heads, cross-attention, a single head on 2 ranks, head sizes unknown at fx level."""
    F = torch.nn.functional

    class Attn(nn.Module):
        def __init__(self, d=8, heads=2, kind=""):
            super().__init__()
            self.h, self.kind = heads, kind
            self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
            self.o = nn.Linear(d, d)
            self.bias = nn.Parameter(torch.zeros(1, heads, 1, 1))

        def forward(self, x, other=None):
            B, T, C = x.shape
            kv = other if self.kind == "cross" else x
            e = C // self.h if self.kind == "fx_sizes" else 8 // self.h
            q, k, v = (
                f(t).view(B, -1, self.h, e).transpose(1, 2)
                for f, t in ((self.q, x), (self.k, kv), (self.v, kv))
            )
            att = q @ k.transpose(-2, -1)
            if self.kind == "learned_bias":
                att = att + self.bias
            att = torch.softmax(att, dim=1 if self.kind == "over_heads" else -1)
            if self.kind == "dropout":
                att = F.dropout(att, 0.1)
            return self.o((att @ v).transpose(1, 2).reshape(B, T, C))

    def reason(model, world_size=2, **kw):
        plan = _plan(model, world_size, **kw)
        assert not any(f.attention for f in _fused(plan).values())
        (why, *others) = plan.unfused.values()
        assert all(other.split()[1:] == why.split()[1:] for other in others)  # a node name apart
        return why

    assert "packed projection" in reason(tiny_gpt())
    assert "computed from parameters" in reason(Attn(kind="learned_bias"))
    assert "dropout" in reason(Attn(kind="dropout"))
    assert "softmax over the head" in reason(Attn(kind="over_heads"))
    x = torch.randn(2, 3, 8)
    cross = reason(Attn(kind="cross"), example_inputs=(x, torch.randn(2, 5, 8)))
    assert "different inputs" in cross
    assert "only 1 whole head group" in reason(Attn(heads=1))
    assert "example_inputs" in reason(Attn(kind="fx_sizes"))
    assert _fused(_plan(Attn(kind="fx_sizes"), 2, example_inputs=(x,)))  # export knows them
    assert _fused(_plan(Attn(heads=1), 1)) and _fused(_plan(Attn(), 2))
