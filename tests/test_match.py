"""`passes.analysis.match` directly: a captured node seen through its op rule (which rule, which
argument is the activation, which parameters play which role, what a parameter chain reads at
run time), the reason a node it cannot shard is gathered, and an adapter's bug raised, naming
the node, instead of becoming such a reason."""

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from rtp_compile.capture.trace import capture
from rtp_compile.passes.analysis import match
from rtp_compile.passes.analysis.match import match_op, parameter_reads, why_not_sharded


def _graph(forward, example=None, **params):
    """`forward(self, x)` over parameters `params` (name -> shape), captured as the compiler
    captures it: torch.fx without an example, torch.export with one."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            for name, shape in params.items():
                self.register_parameter(name, nn.Parameter(torch.randn(*shape)))

    M.forward = forward
    gm = capture(M(), None if example is None else (example,)).gm
    return gm, parameter_reads(gm)


def _reader(gm, reads, target):
    """The one node calling `target` that reads a parameter."""
    found = [
        n
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method")
        and (n.target == target or getattr(n.target, "overloadpacket", None) == target)
    ]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("out_features,in_features", [(5, 3), (7, 12)])
def test_a_linear_is_its_rule_with_the_activation_and_both_roles(out_features, in_features):
    gm, reads = _graph(
        lambda self, x: F.linear(torch.relu(x), self.w, self.b),
        w=(out_features, in_features),
        b=(out_features,),
    )
    node = _reader(gm, reads, F.linear)
    call = match_op(node, gm, reads)
    assert call.rule.name == "linear"
    assert call.params == {"weight": "w", "bias": "b"}
    assert call.input == node.args[0].name and node.args[0].target is torch.relu
    assert call.run_inputs == []


def test_a_linear_of_a_transposed_weight_reads_the_parameter_itself():
    gm, reads = _graph(lambda self, x: F.linear(x, self.w.t()), w=(3, 5))
    call = match_op(_reader(gm, reads, F.linear), gm, reads)
    assert call.rule.name == "linear" and call.params == {"weight": "w"}
    plain_gm, plain_reads = _graph(lambda self, x: F.linear(x, self.w), w=(5, 3))
    plain = match_op(_reader(plain_gm, plain_reads, F.linear), plain_gm, plain_reads)
    assert plain.params == {"weight": "w"}
    assert call.options != plain.options  # the transpose is in what the rule computes with


def test_an_embedding_and_an_aten_linear_match_at_both_capture_levels():
    gm, reads = _graph(lambda self, idx: F.embedding(idx, self.e), e=(11, 4))
    call = match_op(_reader(gm, reads, F.embedding), gm, reads)
    assert call.rule.name == "embedding" and call.params == {"weight": "e"}

    gm, reads = _graph(
        lambda self, x: F.linear(x, self.w, self.b), torch.randn(2, 3), w=(4, 3), b=(4,)
    )
    node = _reader(gm, reads, torch.ops.aten.linear)
    call = match_op(node, gm, reads)
    assert call.rule.name == "linear" and call.params == {"weight": "w", "bias": "b"}


def test_an_elementwise_parameter_through_a_cast_records_what_it_reads_at_run_time():
    gm, reads = _graph(lambda self, x: x * self.g.to(x.dtype), g=(6,))
    node = _reader(gm, reads, operator.mul)
    call = match_op(node, gm, reads)
    assert call.rule.name == "elementwise" and call.params
    assert list(call.params.values()) == ["g"]
    assert call.input == "x"
    ((name, attribute),) = call.run_inputs  # x.dtype, read when the step runs
    reader = next(n for n in gm.graph.nodes if n.name == name)
    assert reader.target is getattr and reader.args == (reader.args[0], "dtype")
    assert reader.args[0].name == "x" and attribute is None


def test_what_a_rule_cannot_shard_is_gathered_with_the_reason():
    gm, reads = _graph(lambda self, x: torch.addmm(self.b, x, self.w, beta=2.0), w=(3, 4), b=(4,))
    node = _reader(gm, reads, torch.addmm)
    assert match_op(node, gm, reads) is None
    assert why_not_sharded(node, gm, reads) == "addmm with beta or alpha other than 1"

    gm, reads = _graph(lambda self, x: F.conv2d(x, self.w, groups=2), w=(4, 1, 3, 3))
    node = _reader(gm, reads, F.conv2d)
    assert match_op(node, gm, reads) is None
    assert "groups=1 only" in why_not_sharded(node, gm, reads)

    gm, reads = _graph(lambda self, x: torch.cumsum(x, 0) * self.w.sum(), w=(3,))
    node = next(n for n in gm.graph.nodes if n.target is operator.mul)
    assert match_op(node, gm, reads) is None  # a reduction of the parameter is not a chain
    closure = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "sum"]
    assert why_not_sharded(node, gm, reads, closure).startswith(
        "mul reads its parameter through sum_1 (sum), which a shard cannot go through"
    )


def test_a_module_call_is_gathered_with_the_way_out():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x)

    gm = fx.symbolic_trace(M())
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert match_op(node, gm, parameter_reads(gm)) is None
    assert "example_inputs" in why_not_sharded(node, gm, parameter_reads(gm))


def test_an_adapter_bug_raises_naming_the_node(monkeypatch):
    gm, reads = _graph(lambda self, x: F.linear(x, self.w), w=(5, 3))
    node = _reader(gm, reads, F.linear)

    def broken(node, gm, reads):
        return {}["missing"]  # a KeyError: a bug of the adapter, not a reason to gather

    monkeypatch.setitem(match.ADAPTERS, F.linear, broken)
    with pytest.raises(RuntimeError, match=rf"adapter of linear failed on node {node.name}"):
        match_op(node, gm, reads)
