"""The time model against measurement: `rtp-compile bench` (`apps.bench_speed`) with each
kind's predicted step (`cost.time`, on a `cost.hardware` description, by default this
machine's as `rtp-compile calibrate` wrote it) beside the measured one, for the presets and
world sizes asked (default: gpt-small and the demo's model at N = 2 and 4). Prints one table
of predicted / measured step per kind and N, saves the rows as JSON (the notebook plots them).

    rtp-compile bench --predict [HARDWARE] [--presets gpt-small demo] [--world-sizes 2 4]
    python benchmarks/time_model.py  (same options)
"""

from __future__ import annotations

import argparse
import json
import pathlib

from rtp_compile.apps.bench_speed import run as bench
from rtp_compile.core.tables import format_table

DEFAULT_HARDWARE = "this-cpu"


def run(
    presets=("gpt-small", "demo"),
    world_sizes=(2, 4),
    hardware: str = DEFAULT_HARDWARE,
    rounds: int = 3,
    steps: int = 3,
    out: str = "benchmarks/out",
) -> list[dict]:
    """Bench every preset with predictions; print the comparison; write `out`/time_model.json."""
    rows = []
    for preset in presets:
        for row in bench(world_sizes, preset, rounds, steps, out, hardware=hardware):
            if "error" in row:
                rows.append({"preset": preset, **row})
    table = [("preset", "N", "kind", "measured ms", "predicted ms", "error")]
    table += [
        (
            r["preset"],
            str(r["N"]),
            r["kind"],
            f"{r['step_ms']:.1f}",
            f"{r['predicted_ms']:.1f}",
            f"{r['error']:+.0%}",
        )
        for r in rows
    ]
    print(f"\ntime model on {hardware}: predicted against measured step (median)")
    print(format_table(table))
    worst = max(abs(r["error"]) for r in rows)
    print(f"largest error {worst:.0%} (target: within 20%)")
    path = pathlib.Path(out) / "time_model.json"
    path.write_text(json.dumps({"hardware": hardware, "rows": rows}, indent=1))
    print(f"rows: {path}")
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default=DEFAULT_HARDWARE)
    parser.add_argument("--presets", nargs="+", default=["gpt-small", "demo"])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    return run(args.presets, args.world_sizes, args.hardware, args.rounds, args.steps, args.out)
