"""The cost model's predictions against measurement: a real 2- and 3-rank job runs one AdamW
step of RTP and of DDP under MemTracker and counts the ring's bytes. Parameter, gradient and
optimizer bytes and the ring traffic must be exact; the peak within 10%; RTP's measured peak
within 1.05 x (single-device model state / N + the unsharded model's activations). The model
has sizes N = 3 does not divide (padded shards). Planning a 7B model on the meta device for 8
ranks stays within 4 GiB of RSS with exact per-rank parameter bytes."""

import re
import subprocess
import sys

import pytest
import sympy
import torch

import rtp_compile
import rtp_compile.cost
from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_loss

CONFIG = GPTConfig(vocab_size=250, block_size=16, n_layer=2, n_head=4, n_embd=100)
BATCH = 4


def _measure(model, seed: int, rank: int) -> dict:
    """One warm step, then one step under MemTracker: the peak, and the state after the step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from rtp_compile.runtime import ring

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed + rank)

    def step(zero=True):
        idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
        lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
        opt.step()
        if zero:
            opt.zero_grad()

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    sent = ring.traffic["bytes"]
    with tracker:
        step(zero=False)
        (state,) = tracker.get_tracker_snapshot().values()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    named = {str(k).rsplit(".", 1)[-1]: v for k, v in state.items()}
    return {
        "param_bytes": named["PARAM"],
        "grad_bytes": named["GRAD"],
        "optimizer_bytes": named["OPT"],
        "peak_bytes": peak["Total"],
        "traffic_bytes": ring.traffic["bytes"] - sent,
        "state_bytes": named["PARAM"] + named["GRAD"] + named["OPT"],
    }


def predicted_and_measured(rank: int, world_size: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = TinyGPT(CONFIG)
    prog = rtp_compile.transform(model, world_size)
    out = {
        "activations": prog.profile(BATCH, CONFIG.block_size).activation_bytes,
        "rtp": (vars(prog.cost(BATCH, CONFIG.block_size)), _measure(prog.module(rank), seed, rank)),
        "ddp": (
            vars(rtp_compile.cost.ddp(prog, BATCH, CONFIG.block_size)),
            _measure(torch.nn.parallel.DistributedDataParallel(model), seed, rank),
        ),
    }
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_predictions_match_memtracker(world_size, seed):
    results = rtp_compile.launch(predicted_and_measured, world_size, args=(seed,), timeout=240)
    for rank, per_kind in enumerate(results):
        # RTP's bound: the single-device model state / N plus the unsharded activations
        bound = per_kind["ddp"][1]["state_bytes"] / world_size + per_kind.pop("activations")
        assert per_kind["rtp"][1]["peak_bytes"] <= 1.05 * bound, (rank, per_kind, bound)
        for kind, (predicted, measured) in per_kind.items():
            for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
                assert predicted[field] == measured[field], (
                    rank,
                    kind,
                    field,
                    predicted[field],
                    measured[field],
                )
            if kind == "rtp":
                assert predicted["traffic_bytes"] == measured["traffic_bytes"], (
                    rank,
                    predicted,
                    measured,
                )
            ratio = predicted["peak_bytes"] / measured["peak_bytes"]
            assert 0.9 <= ratio <= 1.1, (
                f"rank {rank} {kind}: peak predicted "
                f"{predicted['peak_bytes']:,} measured {measured['peak_bytes']:,} ({ratio:.3f})"
            )


@pytest.mark.slow
def test_expressions_are_the_model_at_every_world_size():
    """One plan's expressions, evaluated at N, give what a program built for N predicts;
    they are in N and A only, and the table shows all three kinds side by side."""
    model = TinyGPT(CONFIG)
    two = rtp_compile.transform(model, 2).cost(BATCH, CONFIG.block_size)
    for n in (1, 3, 4, 7):
        direct = rtp_compile.transform(model, n).cost(BATCH, CONFIG.block_size)
        assert vars(two.at(n)) | {"expressions": None} == vars(direct) | {"expressions": None}
    for name, expr in two.expressions.items():
        assert expr.free_symbols <= {
            sympy.Symbol("N", positive=True, integer=True),
            sympy.Symbol("A", positive=True, integer=True),
        }, name
    assert two.param_bytes == sum(
        lay.shard_bytes for lay in rtp_compile.transform(model, 2).plan.params.values()
    )
    text = rtp_compile.cost.table(
        rtp_compile.transform(model, 2), BATCH, CONFIG.block_size, world_sizes=(2, 4)
    )
    assert [line.split()[1] for line in text.splitlines()[3:]] == ["ddp", "fsdp2", "rtp"] * 2


def test_cost_names_what_it_cannot_size():
    prog = rtp_compile.transform(TinyGPT(CONFIG), 2)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        prog.cost(BATCH, CONFIG.block_size, optimizer="lion")
    with pytest.raises(ValueError, match="input 'idx'"):
        prog.cost(BATCH)  # token ids need a sequence length


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama_7b_is_planned_on_the_meta_device_within_4_gib():
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "rtp_compile", "plan", "llama-7b", "--world-sizes", "8"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    ratio = float(
        re.search(r"N=8: RTP parameter bytes per rank [\d,]+ = ([\d.]+) x full/N", out).group(1)
    )
    rss = float(re.search(r"peak RSS ([\d.]+) GiB", out).group(1))
    assert 0.98 <= ratio <= 1.02 and rss <= 4.0, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["8"]]
    assert [r[1] for r in rows] == ["ddp", "fsdp2", "rtp"], out
    peaks = {r[1]: float(r[7]) for r in rows}
    assert peaks["rtp"] < peaks["fsdp2"] < peaks["ddp"], out
