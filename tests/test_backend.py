"""`torch.compile(model, backend="rtp")`: real gloo jobs (rtp_compile.launch), float64.

Both user contracts, (a) `rtp_compile.shard(model)` first and (b) the optimizer built on the
full parameters before compiling, train like DDP; the process then holds about 1/N of the
parameters and gradients; graph breaks, a tied weight read in two graphs, batch-size changes
and a no_grad evaluation keep parity without recompiling on repeated shapes; released
parameters give clear errors instead of crashing. Each job also checks that the backend ran
(dynamo falls back to eager silently on some errors): every parameter has a shard.
"""

import importlib
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from backend_jobs import compiled_parity, default_backend, graph_breaks, mixed_precision
from torch import nn

import rtp_compile
from rtp_compile.compiler.transform import transform

TOL = 1e-9
F32 = 1e-5  # float32 through inductor, first step (measured: up to 8e-7)
# AdamW moves an element by about lr whatever its gradient: where a gradient is about eps,
# float32 rounding changes its update (measured: parameters up to 8e-4 off, relative to their
# largest element); a step not taken or taken twice is off by lr / max |W|, above 0.2 for the
# weight matrices of the tiny Llama (init std 0.02)
F32_PARAMS_AFTER_ADAMW = 1e-2


def _check_parity(results, world_size):
    for rank, per_model in enumerate(results):
        for (name, contract, rank_compiler), r in per_model.items():
            where = f"rank {rank} {name} contract ({contract}), rank program {rank_compiler}"
            for what in ("output", "loss", "grad", "param"):
                assert r[what] <= TOL, f"{where}: {what} rel. error {r[what]:.2e}"
            assert r["sharded"], f"{where}: a parameter has no shard (the backend did not run)"
            assert r["graphs"] == [r["graphs"][0]] * len(r["graphs"]) and r["graphs"][0] >= 1, (
                f"{where}: graphs compiled per step {r['graphs']} (recompiled on equal shapes)"
            )
            # every live parameter and gradient: the shards (with their padding) and theirs
            assert 0.8 / world_size <= r["held"] <= 1.25 / world_size, (
                f"{where}: holds {r['held']:.3f} of the full parameters and gradients"
            )
            if contract == "a":
                assert r["keys"], f"{where}: full_state_dict keys differ from state_dict's"
                # the sharded model run uncompiled, clipped, loaded
                for what in ("eager", "eager_grad", "clip", "load"):
                    assert r[what] <= TOL, f"{where}: {what} rel. error {r[what]:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_models_train_like_ddp_both_contracts(seed):
    """TinyGPT (plain compile after the optimizer: contract b; its rank program compiled whole
    by aot_eager) and GPT-2 with its tied head (sharded first: contract a; rank program run
    eagerly) at N = 2: outputs equal the eager model's, losses, gradients
    and parameters after three AdamW steps DDP's; never recompiled; about 1/2 of the
    parameters and gradients held. The sharded GPT-2 run uncompiled (weights all-gathered)
    matches DDP's output and gradients; clip_grad_norm_ and load_full_state_dict work on it."""
    cases = [("tinygpt", "b", "aot_eager"), ("gpt2", "a", "eager")]
    results = rtp_compile.launch(compiled_parity, 2, args=(cases, seed), timeout=240)
    assert list(results[0]) == cases
    _check_parity(results, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_ranks(seed):
    """Llama (GQA attention, SwiGLU; plain compile) and TinyGPT (sharded first) at N = 3:
    parity with DDP, about 1/3 held."""
    cases = [("llama", "b", "eager"), ("tinygpt", "a", "eager")]
    results = rtp_compile.launch(compiled_parity, 3, args=(cases, seed), timeout=240)
    assert list(results[0]) == cases
    _check_parity(results, 3)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_default_backend_compiles_one_frame_per_rank_program(seed):
    """Llama in float32 through `rtp_compile.backend()` with every default: each rank program
    is compiled by inductor as one frame (dynamo compiles the user's frame while the backend
    emits the rank module, and the code fx generates then is code dynamo skips: compiled as
    emitted, each unit's runtime module would be a frame of its own, guarded on its key, and
    fullgraph fails past the recompile limit), and two AdamW steps train like DDP. The process
    then holds at most 1.10 / N of the model's state, and the rank modules dynamo keeps hold no
    copy of a tensor each call binds (a buffer)."""
    results = rtp_compile.launch(default_backend, 2, args=("llama", seed), timeout=380)
    for rank, r in enumerate(results):
        assert r["programs"] >= 1 and r["rank_frames"] == r["programs"], (
            f"rank {rank}: {r['rank_frames']} frames compiled for {r['programs']} rank programs"
        )
        # the losses after the first step follow from parameters AdamW moved (see
        # F32_PARAMS_AFTER_ADAMW): measured up to 2.1e-4 (the full suite of 2026-12-05)
        for what, tol in (
            ("output", F32),
            ("grad", F32),
            ("loss", F32_PARAMS_AFTER_ADAMW),
            ("param", F32_PARAMS_AFTER_ADAMW),
        ):
            assert r[what] <= tol, f"rank {rank}: {what} rel. error {r[what]:.2e}"
        assert r["graphs"] == [r["programs"]] * 2, f"rank {rank}: recompiled {r['graphs']}"
        assert r["sharded"], f"rank {rank}: a parameter has no shard (the backend did not run)"
        assert 0.8 / 2 <= r["held"] <= 1.25 / 2, f"rank {rank}: holds {r['held']:.3f}"
        # every live tensor, over the full parameters, gradients and AdamW moments / N
        assert r["held_state"] <= 1.10, f"rank {rank}: holds {r['held_state']:.3f} of 1/N"
        # dynamo's cache keeps the rank modules: only placeholders where calls bind tensors
        assert r["bound_bytes"] == 0, f"rank {rank}: rank modules hold {r['bound_bytes']} B"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_graph_breaks_batch_sizes_and_no_grad(seed):
    """A forced graph break in each of two identical layers, an embedding tied to the head
    (read in the first and the last graph), batch sizes 2 -> 3 -> 2 and a no_grad evaluation:
    losses, clipped norms and parameters equal DDP's at every step; the tied weight keeps the
    embedding's layout in both graphs, one shard per parameter; no graph is compiled again for
    shapes seen before. Then: a released parameter's repr / deepcopy / pickle and the model's
    state_dict / load_state_dict raise clear errors (the process survives); load_full_state_dict
    round-trips; an optimizer that stepped before compiling refuses to step the shards."""
    results = rtp_compile.launch(graph_breaks, 2, args=("b", seed), timeout=240)
    for rank, r in enumerate(results):
        for what in ("loss", "norm", "param", "eval"):
            assert r[what] <= TOL, f"rank {rank}: {what} rel. error {r[what]:.2e}"
        graphs = r["graphs"]
        assert graphs[0] >= 2, f"rank {rank}: the break made {graphs[0]} graph(s)"
        # steps with rows 2, 2, 2, 3, 3, 2, then no_grad: compiles only on new shapes / modes
        assert (
            graphs[0] == graphs[1] == graphs[2]
            and graphs[3] == graphs[4] == graphs[5]
            and graphs[3] > graphs[2]
            and graphs[6] > graphs[5]
        ), graphs
        assert r["frames"][0] == r["frames"][2] and r["frames"][3] == r["frames"][5], r["frames"]
        assert r["rank_modules"] == graphs[6]  # each went through the rank_compiler seam
        assert r["one_shard_each"] and r["tied_layout"] == 1, r["plans"]
        assert r["released"]
        for what, message in r["errors"].items():
            assert "rtp_compile" in message and "full_state_dict" in message, (what, message)
        assert r["loaded"] == 0.0
        assert "AdamW holds state for a full parameter" in r["stepped_first"]


@pytest.mark.timeout(60)
def test_rtp_backend_is_registered_once_and_as_an_entry_point():
    """`import rtp_compile` registers backend="rtp" with dynamo (importing it again does not
    register a duplicate, which dynamo would refuse), and pyproject names it as a
    torch_dynamo_backends entry point that loads the same function."""
    from torch._dynamo.backends.registry import lookup_backend

    from rtp_compile.compile_backend.backend import rtp_backend

    assert lookup_backend("rtp") is rtp_backend
    importlib.reload(sys.modules["rtp_compile"])
    assert "rtp" in torch._dynamo.list_backends()
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["torch_dynamo_backends"]["rtp"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is rtp_backend


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(self.emb(x)))))


@pytest.mark.timeout(60)
def test_fixed_layouts_are_kept_by_the_plan():
    """A parameter already sharded keeps its (dim, granule): a use that cannot shard along it is
    gathered (the embedding, cut on the vocabulary), the others adapt (the tied head rotates by
    output rows); a block whose fusion would cut a fixed parameter otherwise is not fused."""
    model, x = _TiedHead(), torch.randint(0, 12, (2, 3))
    free = transform(model, 2, (x,))
    assert free.plan.params["emb.weight"].dim == 1
    assert [u.kind for u in free.plan.units] == ["rotate", "fused", "rotate"], free.report()
    prog = transform(model, 2, (x,), fixed_layouts=[("emb.weight", 0, 1), ("up.weight", 1, 1)])
    assert prog.plan.params["emb.weight"].dim == 0
    embedding, head = prog.plan.units_of("emb.weight")
    assert embedding.kind == "gather" and "already sharded" in embedding.reason
    assert head.kind == "rotate" and head.mode == "col"
    assert all(u.kind != "fused" for u in prog.plan.units), prog.report()
    assert prog.plan.params["up.weight"].dim == 1
    prog = transform(model, 2, (x,), fixed_layouts=[("emb.weight", None, 1)])
    assert prog.plan.params["emb.weight"].dim is None
    assert {u.kind for u in prog.plan.units_of("emb.weight")} == {"gather"}, prog.report()


def _global_rel(a: dict, b: dict) -> float:
    """Relative distance of two sets of gradients, all parameters taken as one vector."""
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    return (diff / sum(float(b[n].double().pow(2).sum()) for n in b)) ** 0.5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_precision_through_the_backend_is_fsdp2s(seed):
    """A model sharded with FSDP2's bfloat16 policy (`rtp_compile.shard(model,
    mp_policy=...)`: every weight read in bfloat16, so dynamo traces the model computing in it,
    as under FSDP2) and compiled by the backend with the same policy computes FSDP2's loss and
    gradients to bfloat16 rounding: within twice FSDP2-bf16's own distance from float32. The
    same policy on a model not sharded with it is refused, saying to shard it first (its graph
    holds the float32 dtypes its code derived)."""
    results = rtp_compile.launch(
        mixed_precision, 2, args=(["tinygpt", "gpt2", "llama"], seed), timeout=240
    )
    for rank, per_model in enumerate(results):
        for name, r in per_model.items():
            (fp32_loss, fp32), (fsdp_loss, fsdp), (rtp_loss, rtp) = r["fp32"], r["fsdp2"], r["rtp"]
            gap = _global_rel(fsdp, fp32)
            assert _global_rel(rtp, fsdp) <= max(2 * gap, 1e-3), (rank, name, gap)
            assert abs(rtp_loss - fsdp_loss) <= max(
                2 * abs(fsdp_loss - fp32_loss), 1e-3 * abs(fsdp_loss)
            ), (rank, name)
            assert "shard it first with the backend's policy" in r["refused"], r["refused"]
