"""A rank's module compiles whole: `torch.compile(prog.module(rank), fullgraph=True)` traces
its ring ops and every unit's autograd into one graph (a break or an untraceable op would
raise), compiles it once for calls of the same shapes (two calls, one frame), and trains like
the eager module (2 ranks, AdamW) without saving a received shard for backward."""

import pytest
from compile_jobs import aot_eager_models, inductor_gpt, many_modules
from jobs import F32_AFTER_ADAMW  # measured: outputs after a step up to 7.8e-5 in CI

import rtp_compile

F64 = 1e-9
F32 = 1e-5  # a few ulp of the largest element (measured: up to 4e-7)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rank_module_compiles_whole_with_aot_eager(seed):
    results = rtp_compile.launch(aot_eager_models, 2, args=(seed,), timeout=380)
    for rank, per_model in enumerate(results):
        assert (
            per_model["gpt"]["BucketRuntime"] and not per_model["gpt, no buckets"]["BucketRuntime"]
        )
        assert per_model["norule"]["GatheredOpRuntime"]
        assert per_model["checkpointed"]["CheckpointedRegion"]
        # a unit's backward is traced, in a bucket or not: its hops in the graph, no opaque op
        for name in ("gpt", "gpt, no buckets"):
            ops = per_model[name]["received"]["backward ops"]
            assert "rtp.unit_backward.default" not in ops, (name, ops)
            assert "rtp.bucket_reduce_scatter.default" not in ops, (name, ops)
            starts = ops.get("rtp.ring_shift_start.default")
            assert starts == ops.get("rtp.ring_wait.default") > 0, (name, ops)
            assert ops.get("rtp.open_transaction.default"), (name, ops)
        for name, r in per_model.items():
            assert r["frames"] == 1, f"rank {rank} {name}: {r['frames']} frames compiled"
            assert r["received"]["in forward"] and not r["received"]["saved"], (rank, name, r)
            for what in ("output", "grad", "output after a step", "grad after a step", "param"):
                assert r[what] <= F64, f"rank {rank} {name}: {what} rel. error {r[what]:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rank_module_compiles_whole_with_inductor(seed):
    for rank, r in enumerate(rtp_compile.launch(inductor_gpt, 2, args=(seed,), timeout=380)):
        assert r["frames"] == 1, f"rank {rank}: {r['frames']} frames compiled"
        for what, tol in (
            ("output", F32),
            ("grad", F32),
            ("output after a step", F32_AFTER_ADAMW),
            ("grad after a step", F32_AFTER_ADAMW),
        ):
            assert r[what] <= tol, f"rank {rank}: {what} rel. error {r[what]:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_modules_of_one_process_compile_without_recompiles(seed):
    (frames,) = rtp_compile.launch(many_modules, 1, args=(seed, 10), timeout=280)
    assert frames == [1] * 10
