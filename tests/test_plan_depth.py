"""Repeated blocks are captured once and copied (`capture.repeats`): the plan, report, cost and
parameter bytes equal those of capturing every block (the independent path: the same model with
no list long enough to copy from), the copied graph computes the model, blocks that differ are
not copied, and the program trains like DDP."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from jobs import travelled_program_parity  # noqa: E402
from torch import nn  # noqa: E402

import rtp_compile  # noqa: E402
from rtp_compile.capture import repeats  # noqa: E402
from rtp_compile.capture.trace import capture  # noqa: E402


def _llama(layers=5, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=22,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=53,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config).double()


IDS = torch.randint(0, 53, (2, 7), generator=torch.Generator().manual_seed(0))


def _everything(model, world_size) -> tuple:
    """What planning says of `model`: plan, report, buckets and every cost field."""
    prog = rtp_compile.transform(model, world_size, example_inputs=(IDS,))
    cost = prog.cost(2, 7)
    return (
        str(prog.plan),
        prog.report(),
        prog.ctx.buckets,
        [getattr(cost, f) for f in cost.FIELDS],
        {k: str(v) for k, v in cost.expressions.items()},
    )


def _every_block_captured(monkeypatch):
    """The independent path: no list is long enough to copy blocks from."""
    monkeypatch.setattr(repeats, "MIN_BLOCKS", 10**9)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_copied_blocks_plan_and_cost_as_every_block_captured(world_size, monkeypatch):
    model = _llama()
    assert repeats.find_repeat(model).varying == {("self_attn", "layer_idx")}
    copied = _everything(model, world_size)
    _every_block_captured(monkeypatch)
    assert copied == _everything(model, world_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_profile_of_copies_is_that_of_the_whole_graph(dtype):
    from rtp_compile.cost import profile

    with torch.device("meta"):
        model = _llama(layers=6).to(dtype)
    ctx = rtp_compile.transform(model, 2, example_inputs=(IDS.to("meta"),)).ctx
    assert ctx.copies is not None and ctx.copies.count == 6
    specs = profile.input_specs(ctx.reference, 3, 11)
    copied = profile.profile_copies(ctx.copies, ctx.params, specs)
    whole = profile.profile_forward(ctx.reference, ctx.params, specs)  # every block run
    assert copied == whole and list(copied.uses) == list(whole.uses)
    assert profile.profile_of(ctx, 3, 11) == whole


def _run(model, forward) -> tuple:
    """The logits of `forward` on IDS and the gradients of their sum in the model's parameters."""
    model.zero_grad()
    out = forward(IDS).logits
    out.sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_copied_graph_is_the_model(monkeypatch):
    model = _llama()
    copied = capture(model, (IDS,)).gm
    out, grads = _run(model, copied)
    assert torch.equal(out, _run(model, model)[0])
    _every_block_captured(monkeypatch)
    whole = capture(model, (IDS,)).gm
    out_whole, grads_whole = _run(model, whole)  # exported whole: the same, bit for bit
    assert torch.equal(out, out_whole)
    assert all(torch.equal(grads[n], grads_whole[n]) for n in grads)
    ops = [
        [(n.op, str(n.target)) for n in gm.graph.nodes if n.op != "get_attr"]
        for gm in (copied, whole)
    ]
    assert ops[0] == ops[1]


def test_the_compilers_graphs_show_and_run_what_their_graph_says():
    """Capture's graph, the reference and the planned program generate their code only when
    it is read or run (`core.lazy_graph`), after every rewrite: it is then what their graph
    says, and the reference computes the model."""
    import copy

    import torch.fx as fx

    model = _llama()
    prog = rtp_compile.transform(model, 2, example_inputs=(IDS,))
    for gm in (prog.ctx.reference, prog.graph_module):
        assert gm.code == fx.GraphModule(gm, copy.deepcopy(gm.graph)).code
    assert torch.equal(prog.ctx.reference(IDS).logits, model(IDS).logits)


def test_a_wider_block_is_not_copied(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = _llama()
    config = model.config
    config_wide = type(config)(**{**config.to_dict(), "intermediate_size": 30})
    model.model.layers[3].mlp = LlamaMLP(config_wide).double()
    assert repeats.find_repeat(model) is None
    planned = _everything(model, 2)
    assert "30x16" in planned[0]
    _every_block_captured(monkeypatch)
    assert planned == _everything(model, 2)


class Scaled(nn.Module):
    """A block whose code reads an attribute that differs from block to block."""

    def __init__(self, scale):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x):
        return self.proj(x) * self.scale if self.scale != 2 else self.proj(x)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Scaled(i) for i in range(5))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_block_reading_what_differs_is_not_copied():
    model = Stack().double()
    assert repeats.find_repeat(model).varying == {("", "scale")}
    x = torch.randn(3, 8, dtype=torch.float64)
    gm = capture(model, (x,)).gm
    assert torch.equal(gm(x), model(x))
    assert len([n for n in gm.graph.nodes if "linear" in str(n.target)]) == 5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_program_of_copied_blocks_trains_like_ddp(seed):
    model = _llama(layers=4, seed=seed)
    prog = rtp_compile.transform(model, 2)
    assert len(prog.plan.units) == 3 + 4 * 4  # embedding, final norm, head; 2 norms, 2 fused
    results = rtp_compile.launch(
        travelled_program_parity, 2, args=(prog, model, "llama", seed), timeout=500
    )
    for rank, r in enumerate(results):
        assert r["plan"] == str(prog.plan), rank
        for what, err in r["errors"].items():
            assert err <= 1e-5, f"rank {rank}: {what} rel. error {err:.2e}"
