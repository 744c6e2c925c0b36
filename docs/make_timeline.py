"""Draws docs/timeline.png: one real training step of a GPT-style model on 2 local ranks (gloo,
CPU), recorded with torch.profiler and plotted by `rtp_compile.timeline`; prints each rank's
overlap. The chrome traces go to benchmarks/out/timeline/ (open ranks.json in Perfetto).

Run from the repository root: python docs/make_timeline.py
"""

import pathlib

import torch

import rtp_compile
from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_step

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = GPTConfig(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=256)
BATCH = 8


def main():
    torch.manual_seed(0)
    prog = rtp_compile.transform(TinyGPT(CONFIG), 2)
    traces = rtp_compile.record_traces(
        lm_step,
        2,
        ROOT / "benchmarks" / "out" / "timeline",
        args=(prog, CONFIG.vocab_size, BATCH, CONFIG.block_size),
        warmup=2,
    )
    tl = rtp_compile.timeline(traces, ROOT / "docs" / "timeline.png")
    print(
        f"TinyGPT {CONFIG.n_layer} layers x {CONFIG.n_embd} wide, vocab {CONFIG.vocab_size}, "
        f"{BATCH} x {CONFIG.block_size} tokens per rank, 2 ranks"
    )
    print(tl)


if __name__ == "__main__":
    main()
