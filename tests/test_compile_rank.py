"""A rank's module compiles whole: `torch.compile(prog.module(rank), fullgraph=True)` traces
its ring ops and every unit's autograd into one graph (a break or an untraceable op would
raise), compiles it once for calls of the same shapes, and trains like the eager module (2
ranks, AdamW)."""
import pytest

import rtp_compile
from compile_jobs import aot_eager_models, inductor_gpt

F64 = 1e-9
F32 = 1e-5


@pytest.mark.timeout(400)
def test_rank_module_compiles_whole_with_aot_eager(seed):
    results = rtp_compile.launch(aot_eager_models, 2, args=(seed,), timeout=380)
    for rank, per_model in enumerate(results):
        assert per_model["gpt"]["buckets"] > 0 and per_model["gpt, no buckets"]["buckets"] == 0
        assert per_model["norule"]["gathered"] > 0
        for name, r in per_model.items():
            assert r["frames"] == 1, f"rank {rank} {name}: {r['frames']} frames compiled"
            for what in ("output", "grad", "param"):
                assert r[what] <= F64, f"rank {rank} {name}: {what} rel. error {r[what]:.2e}"


@pytest.mark.timeout(400)
def test_rank_module_compiles_whole_with_inductor(seed):
    for rank, r in enumerate(rtp_compile.launch(inductor_gpt, 2, args=(seed,), timeout=380)):
        assert r["frames"] == 1, f"rank {rank}: {r['frames']} frames compiled"
        for what in ("output", "grad"):
            assert r[what] <= F32, f"rank {rank}: {what} rel. error {r[what]:.2e}"
