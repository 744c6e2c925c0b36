"""`passes.analysis.cut_axis` directly: the cut of a block's column linears followed through its
region, op by op: the groups a shard may hold, the sizes and operands rewritten per shard, and
what it refuses (`NotExact`, with the reason), on graphs captured as the compiler captures
them."""

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from rtp_compile.core.ir import RewriteKind
from rtp_compile.passes.analysis.cut_axis import CutWalk, NotExact, is_attention, op_kind


def _traced(fn):
    return fx.symbolic_trace(fn)


def _region(gm, first_name, last_name):
    """The nodes strictly after `first_name` up to and including `last_name`, in graph order."""
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    return nodes[names.index(first_name) + 1 : names.index(last_name) + 1]


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


@pytest.mark.parametrize("hidden", [6, 10])
def test_an_mlp_region_is_cut_unit_by_unit_with_nothing_rewritten(hidden):
    def mlp(x, w1, w2):
        h = F.linear(x, w1)
        return F.linear(F.gelu(h) * 2.0, w2)

    gm = _traced(mlp)
    region = _region(gm, "linear", "mul")
    walk = CutWalk(gm, region, {_node(gm, "linear"): hidden}, _node(gm, "mul"), hidden)
    assert walk.groups() == hidden  # any split of the hidden units is exact
    assert walk.rewrites == {}


def test_swiglu_multiplies_two_column_cuts():
    def swiglu(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    gm = _traced(swiglu)
    gate, up, mul = _node(gm, "linear"), _node(gm, "linear_1"), _node(gm, "mul")
    region = [n for n in gm.graph.nodes if n.name in ("silu", "mul")]
    walk = CutWalk(gm, region, {gate: 8, up: 8}, mul, 8)
    assert walk.groups() == 8 and walk.rewrites == {}


def test_attention_heads_are_whole_groups_and_the_view_sizes_are_rewritten():
    heads, head_dim = 2, 4

    def attention(x, wq, wk, wv, wo):
        b, t = x.shape[0], x.shape[1]
        q = F.linear(x, wq).view(b, t, heads, head_dim).transpose(1, 2)
        k = F.linear(x, wk).view(b, t, heads, head_dim).transpose(1, 2)
        v = F.linear(x, wv).view(b, t, heads, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return F.linear(y.transpose(1, 2).reshape(b, t, heads * head_dim), wo)

    gm = _traced(attention)
    q, k, v, out = [n for n in gm.graph.nodes if n.target is F.linear]
    nodes = list(gm.graph.nodes)
    tail_in = out.args[0]
    region = [
        n
        for n in nodes[nodes.index(q) + 1 : nodes.index(tail_in) + 1]
        if n not in (k, v) and n.op in ("call_function", "call_method")
    ]
    width = heads * head_dim
    walk = CutWalk(gm, region, {q: width, k: width, v: width}, tail_in, width)
    assert walk.groups() == heads  # whole heads only: a shard never splits one
    sizes = {
        name: [r for r in rs if r.kind == RewriteKind.SIZE] for name, rs in walk.rewrites.items()
    }
    viewed = [name for name, rs in sizes.items() if rs]
    # every view names the head count and the reshape the width: each becomes the shard's
    assert len(viewed) == 4, walk.rewrites
    assert {r.size for rs in sizes.values() for r in rs} == {heads, heads * head_dim}
    assert any(is_attention(n) for n in region)


def test_a_reduction_over_the_cut_axis_is_refused():
    def reduced(x, w1, w2):
        h = F.linear(x, w1)
        return F.linear(h - h.mean(-1, keepdim=True), w2)

    gm = _traced(reduced)
    sub = next(n for n in gm.graph.nodes if n.target is operator.sub)
    region = _region(gm, "linear", sub.name)
    with pytest.raises(NotExact):
        CutWalk(gm, region, {_node(gm, "linear"): 6}, sub, 6)


def test_a_softmax_over_the_heads_is_refused_and_one_over_keys_is_not():
    def over(dim):
        def attention(x, wq, wo):
            q = F.linear(x, wq).view(x.shape[0], x.shape[1], 2, 3)
            return F.linear(torch.softmax(q, dim=dim).reshape(x.shape[0], x.shape[1], 6), wo)

        return _traced(attention)

    for dim, exact in ((2, False), (-1, True)):
        gm = over(dim)
        q, tail = [n for n in gm.graph.nodes if n.target is F.linear]
        nodes = list(gm.graph.nodes)
        region = [
            n
            for n in nodes[nodes.index(q) + 1 : nodes.index(tail)]
            if n.op in ("call_function", "call_method")
            and n.target is not getattr
            and n.target != operator.getitem
            and n.target != "size"
        ]
        if exact:
            walk = CutWalk(gm, region, {q: 6}, tail.args[0], 6)
            assert walk.groups() in (2, 6)
        else:
            with pytest.raises(NotExact):
                CutWalk(gm, region, {q: 6}, tail.args[0], 6)


def test_the_cut_must_reach_the_last_layers_input():
    def detour(x, w1, w2):
        h = F.linear(x, w1)
        return F.linear(h.transpose(-1, -2).transpose(-1, -2) + 1.0, w2)

    gm = _traced(detour)
    nodes = list(gm.graph.nodes)
    first, tail = [n for n in nodes if n.target is F.linear]
    region = nodes[nodes.index(first) + 1 : nodes.index(tail)]
    walk = CutWalk(gm, region, {first: 5}, tail.args[0], 5)  # transposes carry the cut back
    assert walk.groups() == 5
    with pytest.raises(NotExact, match="does not reach"):
        CutWalk(gm, region, {first: 5}, tail.args[0], 7)  # the last layer reads 7 wide

    def summed(x, w1, w2):
        return F.linear(F.linear(x, w1).sum(0, keepdim=True), w2)

    gm = _traced(summed)
    nodes = list(gm.graph.nodes)
    first, tail = [n for n in nodes if n.target is F.linear]
    with pytest.raises(NotExact, match="no rule for running on a slice"):
        CutWalk(gm, nodes[nodes.index(first) + 1 : nodes.index(tail)], {first: 5}, tail.args[0], 5)


def test_op_kinds_of_representative_nodes():
    def f(x, w):
        h = F.linear(x, w)
        return torch.relu(h).view(2, -1).transpose(0, 1) @ h.view(-1, 2)

    gm = _traced(f)
    kinds = {n.name: op_kind(n) for n in gm.graph.nodes if n.op != "placeholder"}
    assert kinds["relu"] is not None and kinds["view"] is not None
    assert kinds["relu"] != kinds["view"]
    assert not any(is_attention(n) for n in gm.graph.nodes if n.target is torch.relu)
