"""The runtime's own cost, without communication: one rank's AdamW step under a `fake` process
group (every collective and hop returns at once) divided by the unsharded model's step.

A rank computes what the unsharded model computes (its batch, every weight once per step, in
1/N pieces), so with communication free the ratio is what the rank program adds: per-step
Python, small ops (narrow, view, packing) and the pieces' smaller matmuls. It is measured
eager (the rank module against the unsharded model, both eager) and compiled
(`torch.compile(m, fullgraph=True)` of each, inductor). One process per world size, rank 0;
after warm-up steps (the compiled ones compile then), `rounds` interleaved rounds of `steps`
timed steps, the order alternating each round; the ratio is the median of the per-round ratios
of median steps.

    rtp-compile bench --overhead [--world-sizes 2 4 8] [--rounds 5] [--steps 5]
    python benchmarks/overhead.py   (same options)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time

import torch

from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_loss
from rtp_compile.core.tables import format_table

MODEL = GPTConfig()  # 2 layers x 64 wide, vocab 96
BATCH, SEQ_LEN = 16, 32
MODES = ("eager", "compiled")
TARGETS = {"eager": {2: 1.3, 4: 1.6, 8: 2.2}, "compiled": {2: 1.15, 4: 1.3, 8: 1.6}}


def measure(world_size: int, mode: str, rounds: int, steps: int) -> dict:
    """In a fresh process: rank 0's step and the unsharded model's step (seconds, per round),
    both `mode` (eager or compiled)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rtp_compile.compiler.transform import transform

    torch.set_num_threads(1)  # one core per measurement: the two cores' noise kept out
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = TinyGPT(MODEL)
        modules = {
            "unsharded": copy.deepcopy(model),
            "rank": transform(model, world_size).module(0),
        }
        if mode == "compiled":
            modules = {k: torch.compile(m, fullgraph=True) for k, m in modules.items()}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in modules.items()}
        gen = torch.Generator().manual_seed(1)

        def step(kind: str) -> float:
            idx = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN + 1), generator=gen)
            start = time.perf_counter()
            lm_loss(modules[kind](idx[:, :-1]), idx[:, 1:]).backward()
            opts[kind].step()
            opts[kind].zero_grad()
            return time.perf_counter() - start

        for _ in range(3):  # optimizer state; compilation (a recompile when grads appear)
            for kind in modules:
                step(kind)
        kinds = list(modules)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(rounds):
            for kind in kinds[r % 2 :] + kinds[: r % 2]:
                times[kind].append(statistics.median(step(kind) for _ in range(steps)))
        return times
    finally:
        dist.destroy_process_group()


def run(world_sizes=(2, 4, 8), rounds: int = 5, steps: int = 5, modes=MODES) -> list[dict]:
    """Measure every (mode of `modes`, N) in its own process; print the table; return its
    rows."""
    rows = []
    for mode in modes:
        for n in world_sizes:
            one = [sys.executable, "-m", "rtp_compile.apps.bench_overhead", "--one", mode]
            one += [str(n), str(rounds), str(steps)]
            done = subprocess.run(one, capture_output=True, text=True, timeout=1200)
            if done.returncode:
                raise RuntimeError(f"overhead benchmark, {mode} N={n} failed:\n{done.stderr}")
            times = json.loads(done.stdout.splitlines()[-1])
            ratios = [r / u for r, u in zip(times["rank"], times["unsharded"])]
            rows.append(
                {
                    "mode": mode,
                    "N": n,
                    "unsharded_ms": 1e3 * statistics.median(times["unsharded"]),
                    "rank_ms": 1e3 * statistics.median(times["rank"]),
                    "ratio": statistics.median(ratios),
                    "target": TARGETS[mode].get(n),
                }
            )
    print(
        f"rank step / unsharded step, fake process group, rank 0 of N, AdamW; model "
        f"{MODEL.n_layer} x {MODEL.n_embd} (vocab {MODEL.vocab_size}), batch {BATCH} x {SEQ_LEN}"
    )
    print(
        format_table(
            [["mode", "N", "unsharded ms", "rank ms", "rank / unsharded", "target"]]
            + [
                [
                    r["mode"],
                    r["N"],
                    f"{r['unsharded_ms']:.2f}",
                    f"{r['rank_ms']:.2f}",
                    f"{r['ratio']:.2f}",
                    "" if r["target"] is None else f"<= {r['target']}",
                ]
                for r in rows
            ],
        )
    )
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per kind and round")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # MODE N ROUNDS STEPS
    args = parser.parse_args(argv)
    if args.one:
        mode, n, rounds, steps = args.one
        print(json.dumps(measure(int(n), mode, int(rounds), int(steps))))
        return []
    return run(args.world_sizes, args.rounds, args.steps)


if __name__ == "__main__":
    main()
