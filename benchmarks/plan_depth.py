"""Planning cost against depth (issue 23): `transform` then `cost(1, 8192)` of the 405B-shape
Llama on the meta device at N = 512, full depth (126 layers) and half (63), interleaved, each in
a fresh process; prints every run, the medians and their ratio (the target: <= 1.25).

    python benchmarks/plan_depth.py [--rounds 3] [--profile full|half]

Run it from the checkout's root: each run is `python -c`, which imports rtp_compile from the
working directory first.

Each run reports wall time and the process's CPU time: on a shared VM the wall time drifts
with other tenants (steal), the CPU time much less.

`--profile`: run that depth once under cProfile instead and print the top of the profile.
"""

import argparse
import json
import statistics
import subprocess
import sys

ONE = """
import json, resource, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import rtp_compile
from rtp_compile.apps.presets import LLAMA, LLAMA_2

layers = int(sys.argv[1])
config = LlamaConfig(**{**LLAMA_2, **LLAMA["llama-3.1-405b"], "num_hidden_layers": layers})
with torch.device("meta"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
start, cpu = time.perf_counter(), time.process_time()
prog = rtp_compile.transform(model, 512, example_inputs=(ids,))
prog.cost(1, 8192)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"layers": layers, "s": seconds, "cpu_s": cpu, "rss_gib": rss}))
"""

PROFILE = """
import cProfile, pstats, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import rtp_compile
from rtp_compile.apps.presets import LLAMA, LLAMA_2

layers = int(sys.argv[1])
config = LlamaConfig(**{**LLAMA_2, **LLAMA["llama-3.1-405b"], "num_hidden_layers": layers})
with torch.device("meta"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
with cProfile.Profile() as p:
    rtp_compile.transform(model, 512, example_inputs=(ids,)).cost(1, 8192)
pstats.Stats(p).sort_stats("cumulative").print_stats(60)
"""

FULL, HALF = 126, 63


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", choices=["full", "half"])
    args = parser.parse_args()
    if args.profile:
        layers = FULL if args.profile == "full" else HALF
        subprocess.run([sys.executable, "-c", PROFILE, str(layers)], check=True)
        return
    runs: dict[int, list[dict]] = {FULL: [], HALF: []}
    for _ in range(args.rounds):
        for layers in (FULL, HALF):
            out = subprocess.run(
                [sys.executable, "-c", ONE, str(layers)], check=True, capture_output=True, text=True
            ).stdout
            run = json.loads(out.strip().splitlines()[-1])
            runs[layers].append(run)
            print(
                f"{layers:4d} layers: {run['s']:.2f} s ({run['cpu_s']:.2f} s of CPU), "
                f"peak RSS {run['rss_gib']:.2f} GiB"
            )
    rss = max(r["rss_gib"] for r in runs[FULL])
    for key, what in (("s", "wall"), ("cpu_s", "CPU")):
        full, half = (statistics.median(r[key] for r in runs[n]) for n in (FULL, HALF))
        print(
            f"median {what} time: {FULL} layers {full:.2f} s, {HALF} layers {half:.2f} s, "
            f"ratio {full / half:.2f}"
        )
    print(f"peak RSS {rss:.2f} GiB (CPU time: the process's own, not what a busy VM steals)")


if __name__ == "__main__":
    main()
