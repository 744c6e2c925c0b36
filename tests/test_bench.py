"""`rtp-compile bench` runs end to end on a tiny model (a smoke run for correctness: no timing
is asserted): every kind measured, RTP's messages and bytes as its plan says, a trace and a
plot saved; the tensor-parallel baseline computes what the model computes."""

import json

import pytest
import torch
from jobs import tensor_parallel_matches

import rtp_compile
from rtp_compile.apps import bench_overhead as overhead
from rtp_compile.apps.bench_speed import KINDS, PRESETS, program, run
from rtp_compile.apps.models import TinyGPT


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_smoke_run_measures_every_kind(tmp_path):
    rows = run(world_sizes=(2,), preset="tiny", rounds=1, steps=1, out=str(tmp_path))
    assert [r["kind"] for r in rows] == list(KINDS)
    by_kind = {r["kind"]: r for r in rows}
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_mb"] > 0 for r in rows)
    _, batch, seq_len = PRESETS["tiny"]
    for r in rows:  # like with like: every kind the same global batch (TP's ranks share it)
        assert r["tokens_per_s"] * r["step_ms"] / 1e3 == pytest.approx(2 * batch * seq_len)
    model = TinyGPT(PRESETS["tiny"][0]).float()  # as the ranks build it (float32)
    prog = rtp_compile.transform(model, 2)
    plan, buckets = prog.plan, prog.ctx.buckets
    rtp = by_kind["rtp"]
    rotating = [u for u in plan.units if u.kind != "small"]
    alone = [u for u in rotating if not any(u.name in b for b in buckets.values())]
    small = {p for u in plan.units if u.kind == "small" for p in u.params.values()}
    # every bucket and rotating unit outside one: forward, weight fetch, gradient (N - 1
    # each); the small parameters together: one all-gather, one reduce-scatter
    assert buckets and small and rtp["messages"] == 3 * (len(alone) + len(buckets)) + 2
    messages = sum(plan.params[p].shard_bytes for u in rotating for p in u.params.values())
    small_bytes = sum(plan.params[p].shard_bytes for p in small)
    assert rtp["sent_mb"] * 1e6 == pytest.approx(3 * messages + 2 * small_bytes)  # tied: twice
    assert 0 <= rtp["exposed"] < 1
    params = sum(p.numel() * 4 for p in model.parameters())
    assert by_kind["ddp"]["sent_mb"] * 1e6 == pytest.approx(params)  # all-reduce: 2(N-1)/N
    assert by_kind["tp"]["messages"] == 4 * PRESETS["tiny"][0].n_layer  # 2 forward, 2 back
    assert by_kind["ddp"]["vs_first"] == 1.0
    trace = json.loads((tmp_path / "trace_rtp_N2_rank0.json").read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("rtp.wait") for e in trace)
    assert (tmp_path / "speed.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_overhead_benchmark_measures_the_rank_step_against_the_unsharded_one():
    # eager only: the compiled mode's rank program is tested compiling in test_compile_rank
    # (inductor and aot_eager), and compiling it again here cost a minute of CI
    rows = overhead.run(world_sizes=(2,), rounds=1, steps=1, modes=("eager",))
    assert [(r["mode"], r["N"]) for r in rows] == [("eager", 2)]
    # a rank does the unsharded model's work and more: its step is never faster than a
    # tenth of it, and both are real times
    assert all(r["unsharded_ms"] > 0 and r["rank_ms"] > 0.1 * r["unsharded_ms"] for r in rows)
    assert all(r["ratio"] == pytest.approx(r["rank_ms"] / r["unsharded_ms"]) for r in rows)


@pytest.mark.timeout(300)
def test_tensor_parallel_baseline_computes_the_model(seed):
    errors = rtp_compile.launch(tensor_parallel_matches, 2, args=(seed,), timeout=120)
    assert max(errors) <= 1e-5


@pytest.mark.timeout(120)
def test_bucket_comparison_kinds_capture_alike_and_auto_takes_its_choice():
    """`bench --buckets` compares "rtp-export" (default buckets) with "rtp-auto": both captured
    by torch.export of one batch, so the only difference is the bucket size; an unknown kind
    is refused before any rank starts."""
    config, batch, seq = PRESETS["tiny"]
    example = torch.zeros(batch, seq, dtype=torch.long)
    progs = {}
    for kind in ("rtp", "rtp-export", "rtp-auto"):
        torch.manual_seed(0)
        progs[kind] = program(kind, TinyGPT(config), 3, example, hardware="this-cpu")
    assert str(progs["rtp"].plan) == str(progs["rtp-export"].plan)
    assert progs["rtp-export"].ctx.buckets == progs["rtp"].ctx.buckets
    choice = progs["rtp-auto"].ctx.bucket_choice
    torch.manual_seed(0)
    again = rtp_compile.transform(
        TinyGPT(config), 3, example_inputs=(example,), bucket_bytes=choice.chosen
    )
    assert progs["rtp-auto"].ctx.buckets == again.ctx.buckets
    with pytest.raises(ValueError, match="unknown kinds"):
        run(world_sizes=(2,), preset="tiny", kinds=("rtp", "nope"))
