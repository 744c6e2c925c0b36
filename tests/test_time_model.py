"""The time model (`rtp_compile.cost.time`) against what must hold whatever the hardware: the
profile counts a matmul's FLOPs exactly; with free memory traffic, launches and runtime, the
three kinds compute the same forward and backward (RTP's N steps of 1/N add up to the whole);
with latency-free links, the link is busy for exactly the bytes the memory model says each
kind sends (which tests/test_cost.py holds against real sends); slower links never make a
step faster; and the descriptions load, or fail naming what to pass. Prediction against
measured step times is a benchmark (`rtp-compile bench --predict`), not a test."""

import dataclasses
import json

import pytest
import torch
from torch import nn

import rtp_compile
import rtp_compile.cost as cost
from rtp_compile.apps.cli import main as cli
from rtp_compile.apps.models import GPTConfig, TinyGPT
from rtp_compile.cost import hardware

CONFIG = GPTConfig(vocab_size=250, block_size=16, n_layer=2, n_head=4, n_embd=100)
BATCH, SEQ = 4, 16


def _described(**changes) -> hardware.Hardware:
    base = {
        "name": "test",
        "source": "a test",
        "host_runs_ahead": False,
        "compute": {
            "matmul_flops": {"float32": 1e11},
            "memory_bandwidth": 1e10,
            "op_overhead_s": 5e-6,
        },
        "levels": [{"name": "link", "ranks": None, "latency_s": 1e-4, "bandwidth": 1e9}],
        "runtime": {"rtp_step_overhead_s": 1e-4},
    }
    for key, value in changes.items():
        if key in base["compute"]:
            base["compute"][key] = value
        elif key in ("latency_s", "bandwidth"):
            base["levels"][0][key] = value
        elif key == "rtp_step_overhead_s":
            base["runtime"][key] = value
        else:
            base[key] = value
    return hardware.Hardware.from_dict(base)


def _times(n: int, described, **transform_opts) -> dict:
    torch.manual_seed(0)
    prog = rtp_compile.transform(TinyGPT(CONFIG), n, **transform_opts)
    return {
        f.__name__: f(prog, BATCH, SEQ, hardware=described) for f in (cost.ddp, cost.fsdp, cost.rtp)
    }


def test_the_profile_counts_each_linear_s_flops():
    model = nn.Sequential(nn.Linear(48, 80), nn.ReLU(), nn.Linear(80, 24))
    prog = rtp_compile.transform(model, 2)
    profile = prog.profile(7, example_kwargs={"input": torch.randn(7, 48)})
    by_weight = {}
    for op in profile.ops:
        for name in op.reads:
            if name.endswith("weight") and op.flops:
                by_weight[name] = op.flops
    assert by_weight == {"0.weight": 2 * 7 * 48 * 80, "2.weight": 2 * 7 * 80 * 24}
    assert sum(op.flops for op in profile.ops) == 2 * 7 * (48 * 80 + 80 * 24)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_with_free_traffic_every_kind_computes_the_same_forward_and_backward(n):
    free = _described(
        memory_bandwidth=1e30, op_overhead_s=0.0, rtp_step_overhead_s=0.0, latency_s=0.0
    )
    times = {k: c.time for k, c in _times(n, free).items()}
    work = {k: t.compute_s - t.optimizer_s for k, t in times.items()}
    assert work["rtp"] > 0
    for kind in ("ddp", "fsdp"):
        assert work[kind] == pytest.approx(work["rtp"], rel=1e-9), (kind, work)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("bucket_bytes", [None, 0])
def test_without_latency_the_link_carries_the_memory_model_s_traffic(n, bucket_bytes):
    bandwidth = 1e9
    described = _described(latency_s=0.0, bandwidth=bandwidth)
    costs = _times(n, described, bucket_bytes=bucket_bytes)
    rtp = costs["rtp"]
    assert rtp.time.comm_s * bandwidth == pytest.approx(rtp.traffic_bytes, rel=1e-6)
    for kind in ("ddp", "fsdp"):  # the ring algorithms' bytes per rank
        c = costs[kind]
        assert c.time.comm_s * bandwidth == pytest.approx(c.traffic_bytes, rel=1e-6), kind


def test_a_slower_link_never_makes_a_step_faster_and_shows_as_exposed_time():
    fast, slow = (
        _times(4, _described(bandwidth=b, latency_s=lat)) for b, lat in ((1e12, 0), (1e7, 1e-3))
    )
    for kind in fast:
        assert slow[kind].step_time > fast[kind].step_time, kind
        assert slow[kind].time.exposed_s > fast[kind].time.exposed_s, kind
        assert fast[kind].time.step_s >= fast[kind].time.compute_s


def test_one_rank_sends_nothing():
    times = _times(1, _described())
    for kind, c in times.items():
        assert c.time.comm_s == 0 and c.time.exposed_s == 0, kind


def test_a_two_d_mesh_adds_the_replicas_all_reduce_across_nodes():
    node = _described(
        levels=[
            {"name": "node", "ranks": 2, "latency_s": 1e-5, "bandwidth": 1e11},
            {"name": "across", "ranks": None, "latency_s": 1e-4, "bandwidth": 1e8},
        ]
    )
    torch.manual_seed(0)
    prog = rtp_compile.transform(TinyGPT(CONFIG), 2)
    text = cost.table(prog, BATCH, SEQ, world_sizes=(2, 8), hardware=node)
    rows = {tuple(line.split()[:2]): line.split() for line in text.splitlines()[2:]}
    assert ("8", "rtp") in rows and any(
        k[0] == "8" and "2-D" in " ".join(v) for k, v in rows.items()
    )
    two_d = next(v for k, v in rows.items() if k[0] == "8" and "2-D" in " ".join(v))
    ring = rows[("2", "rtp")]
    assert float(two_d[-2]) > float(ring[-2])  # the ring's step plus the replicas' all-reduce
    assert two_d[4:9] == ring[2:7]  # its memory: the ring's plan's
    mesh = cost.rtp_2d(prog, 8, BATCH, SEQ, hardware=node)  # the row, as a Cost
    assert (mesh.world_size, f"{mesh.time.step_s:.3g}") == (8, two_d[-2])
    assert mesh.peak_bytes == cost.rtp(prog, BATCH, SEQ).peak_bytes
    with pytest.raises(ValueError, match="world_size=3 must be a multiple of"):
        cost.rtp_2d(prog, 3, BATCH, SEQ, hardware=node)


def test_rates_follow_the_ring_algorithms_and_calibration_overrides_them():
    described = _described(
        measured={"4": {"all_reduce": [1.0, 2.0], "memory_bandwidth": 3e9}},
    )
    at2, at4 = described.rates(2), described.rates(4)
    assert at2.all_reduce.latency_s == pytest.approx(2 * 1e-4)
    assert at2.all_gather.per_byte_s == pytest.approx(1 / 2 / 1e9)
    assert (at4.all_reduce.latency_s, at4.all_reduce.per_byte_s) == (1.0, 2.0)
    assert at4.memory_bandwidth == 3e9 and at2.memory_bandwidth == 3e9  # the nearest measured
    assert at4.hop.latency_s == 1e-4  # not measured there: from the level


def test_shipped_descriptions_load_and_a_bad_one_names_what_to_pass(tmp_path):
    assert {"h100-nvlink", "a100-nvlink", "this-cpu"} <= set(hardware.names())
    for name in hardware.names():
        assert hardware.load(name).rates(16).flops(2) > 0
    with pytest.raises(ValueError, match="h100-nvlink"):
        hardware.load("h900")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"name": "x", "compute": {}}))
    with pytest.raises(ValueError, match="levels"):
        hardware.load(broken)


def test_plan_prints_each_kind_s_predicted_step(capsys):
    assert (
        cli(
            [
                "plan",
                "llama-7b",
                "--world-sizes",
                "8",
                "--hardware",
                "h100-nvlink",
                "--seq-len",
                "256",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "step s" in out and "time model: h100-nvlink" in out
    steps = [float(line.split()[-2]) for line in out.splitlines() if line.split()[:1] == ["8"]]
    assert len(steps) == 3 and all(s > 0 for s in steps)


def test_plan_with_an_unknown_hardware_exits_2_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["plan", "llama-7b", "--world-sizes", "8", "--hardware", "nope"])
    assert exit_.value.code == 2
    assert "h100-nvlink" in capsys.readouterr().err


def test_step_time_is_none_without_hardware_and_kept_by_replace():
    torch.manual_seed(0)
    prog = rtp_compile.transform(TinyGPT(CONFIG), 2)
    assert prog.cost(BATCH, SEQ).step_time is None
    timed = prog.cost(BATCH, SEQ, hardware=_described())
    assert timed.step_time == timed.time.step_s > 0
    assert dataclasses.replace(timed).step_time == timed.step_time


# -- bucket_bytes="auto" -------------------------------------------------------------------
def _auto(described, n=4, **opts):
    torch.manual_seed(0)
    x = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
    return rtp_compile.transform(
        TinyGPT(CONFIG), n, example_inputs=(x,), bucket_bytes="auto", hardware=described, **opts
    )


def test_auto_buckets_take_the_fastest_predicted_size_within_the_budget():
    prog = _auto(_described())
    choice = prog.ctx.bucket_choice
    sizes = [size for size, _, _ in choice.candidates]
    assert 0 in sizes and max(sizes) == choice.budget
    best = min(choice.candidates, key=lambda c: (c[2], c[0]))
    assert choice.chosen == best[0]
    fixed = rtp_compile.transform(
        TinyGPT(CONFIG),
        4,
        example_inputs=(torch.zeros(BATCH, SEQ, dtype=torch.long),),
        bucket_bytes=choice.chosen,
    )
    assert prog.ctx.buckets == fixed.ctx.buckets  # the same buckets as that size given
    assert "chosen" in str(choice)


def test_auto_buckets_follow_the_link_latency():
    """Slow messages (10 ms each): buckets (fewer hops) beat none, and the smallest size that
    is fastest is chosen; with free messages buckets gain nothing, and none are chosen."""
    slow = _auto(_described(latency_s=1e-2), max_bytes_in_flight=2**26)
    steps = {size: step for size, _, step in slow.ctx.bucket_choice.candidates}
    chosen = slow.ctx.bucket_choice.chosen
    assert steps[chosen] < 0.8 * steps[0] and slow.ctx.buckets
    assert chosen == min(size for size, step in steps.items() if step == min(steps.values()))
    quick = _auto(_described(latency_s=0.0, bandwidth=1e15, rtp_step_overhead_s=0.0))
    assert quick.ctx.bucket_choice.chosen == 0 and not quick.ctx.buckets


def test_auto_buckets_need_the_captured_batch():
    with pytest.raises(ValueError, match="example_inputs"):
        rtp_compile.transform(TinyGPT(CONFIG), 2, bucket_bytes="auto", hardware=_described())
    with pytest.raises(ValueError, match="auto"):
        rtp_compile.transform(TinyGPT(CONFIG), 2, bucket_bytes="big")
