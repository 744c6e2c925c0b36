"""A rank's module eager against the same module compiled whole by inductor: step time per rank.

`torch.compile(prog.module(rank), fullgraph=True)` (the default backend) on the speed benchmark's
model (`rtp_compile.apps.bench_speed`, preset gpt-small by default): one job of N local processes,
both modules built from the same program (the same shards), each with its own AdamW. After a
warm-up step each (the compiled one compiles then), `rounds` interleaved rounds of `steps`
timed steps, the order alternating each round; a step is forward, `lm_loss` backward and
the AdamW step, started after a barrier. Printed per rank: the median step of each, and the
median of the per-round ratios compiled / eager; and the compile time of the first call.

    python benchmarks/compiled_rank.py [--preset gpt-small] [--world-sizes 2] [--rounds 4]
                                       [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import rtp_compile
from rtp_compile.apps.bench_speed import PRESETS
from rtp_compile.apps.models import TinyGPT, lm_loss
from rtp_compile.core.tables import format_table

KINDS = ("eager", "compiled")


def measure(rank: int, world_size: int, preset: str, rounds: int, steps: int) -> dict:
    """Per kind, this rank's timed steps per round, and the first (compiling) call's time."""
    config, batch, seq_len = PRESETS[preset]
    torch.manual_seed(0)
    prog = rtp_compile.transform(TinyGPT(config), world_size)
    modules = {"eager": prog.module(rank)}
    modules["compiled"] = torch.compile(prog.module(rank), fullgraph=True)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in modules.items()}
    gen = torch.Generator().manual_seed(rank + 1)

    def step(kind):
        idx = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        lm_loss(modules[kind](idx[:, :-1]), idx[:, 1:]).backward()
        opts[kind].step()
        opts[kind].zero_grad()
        return time.perf_counter() - start

    first = {k: step(k) for k in KINDS}  # warm-up: optimizer state; compilation
    times = {k: [] for k in KINDS}
    for r in range(rounds):
        for kind in KINDS[r % 2 :] + KINDS[: r % 2]:
            times[kind].append([step(kind) for _ in range(steps)])
    return {
        "first": first,
        "rounds": {k: [statistics.median(t) for t in times[k]] for k in KINDS},
        "all": {k: [s for t in times[k] for s in t] for k in KINDS},
    }


def main(argv=None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-small", choices=sorted(PRESETS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    config, batch, seq_len = PRESETS[args.preset]
    rows = [("N", "rank", "eager ms", "compiled ms", "compiled / eager", "first call s")]
    for n in args.world_sizes:
        ranks = rtp_compile.launch(
            measure, n, args=(args.preset, args.rounds, args.steps), timeout=1800
        )
        for rank, r in enumerate(ranks):
            eager, compiled = (statistics.median(r["all"][k]) for k in KINDS)
            ratio = statistics.median(
                c / e for c, e in zip(r["rounds"]["compiled"], r["rounds"]["eager"])
            )
            rows.append(
                (
                    n,
                    rank,
                    f"{eager * 1e3:.1f}",
                    f"{compiled * 1e3:.1f}",
                    f"{ratio:.2f}",
                    f"{r['first']['compiled']:.1f}",
                )
            )
    print(
        f"{args.preset}: {config.n_layer} layers x {config.n_embd} wide, vocab "
        f"{config.vocab_size}, {batch} x {seq_len} tokens per rank, AdamW; {args.rounds} "
        f"interleaved rounds of {args.steps} steps; compiled: torch.compile(prog.module(rank), "
        f"fullgraph=True), inductor"
    )
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
