"""The project's main job: train TinyGPT with Rotated Tensor Parallelism next to a DDP replica.

`run_demo` spawns `world_size` CPU ranks with `rtp_compile.launch`. In the same job every rank
trains two copies of one initial model on the same per-rank batches with the same AdamW
settings: the rank's RTP program (1/N of every weight) and a DistributedDataParallel replica
(every weight). Both compute the same math, so their losses should agree; the demo prints the
losses side by side, the per-rank parameter bytes of each, the measured peak memory of a step
and the time per step, and returns the numbers.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rtp_compile.compiler import transform
from rtp_compile.models import GPTConfig, TinyGPT, lm_loss
from rtp_compile.runtime.launch import launch
from rtp_compile.tables import format_table

BATCH_SIZE = 16  # sequences per rank per step
LR = 3e-3
MULTIPLIER, INCREMENT = 5, 3  # next token = (prev * 5 + 3) % vocab: a permutation of the vocab


def batch_seed(seed: int, rank: int, step: int) -> int:
    """The generator seed of one rank's batch at one step, distinct for every (seed, rank, step)."""
    # seed + rank + step would hand rank 1 at step s the batch of rank 0 at step s + 1.
    return (seed * 1_000_003 + step) * 1_009 + rank


def make_batch(cfg: GPTConfig, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that start at a random token and continue with next = (prev * 5 + 3) % vocab.

    Returns (inputs, targets), both [batch_size, block_size]; targets are inputs shifted by one.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(cfg.vocab_size, (batch_size,), generator=gen)]
    for _ in range(cfg.block_size):
        tokens.append((tokens[-1] * MULTIPLIER + INCREMENT) % cfg.vocab_size)
    seq = torch.stack(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters `module` holds (a tied parameter counts once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, idx, targets,
                track_memory: bool) -> tuple[float, float, int | None]:
    """One AdamW step; returns (loss, seconds, peak bytes or None when memory isn't tracked)."""
    tracker = None
    if track_memory:
        # A private torch module: import it only when memory is tracked.
        from torch.distributed._tools.mem_tracker import MemTracker
        tracker = MemTracker()
        tracker.track_external(model, opt, idx, targets)
    start = time.perf_counter()
    with tracker if tracker is not None else contextlib.nullcontext():
        loss = lm_loss(model(idx), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    peak = None
    if tracker is not None:
        peak = sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())
    return loss.item(), seconds, peak


def memory_step(steps: int) -> int:
    """The 0-based step whose peak memory is tracked: the second, the first with optimizer state."""
    return min(1, steps - 1)


def _rank_job(rank: int, world_size: int, model: nn.Module, steps: int, seed: int,
              track_memory: bool) -> dict:
    """Runs on each rank: train the RTP program and a DDP replica side by side."""
    ddp = DistributedDataParallel(copy.deepcopy(model))
    # Every rank compiles the same model itself (what a pickled program does too).
    prog = transform(model, world_size)
    gm = prog.module(rank)
    rtp_opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    out = {"rtp_loss": [], "ddp_loss": [], "rtp_s": [], "ddp_s": [],
           "rtp_peak": None, "ddp_peak": None,
           "rtp_param_bytes": param_bytes(gm), "ddp_param_bytes": param_bytes(ddp.module)}
    for step in range(steps):
        idx, targets = make_batch(model.cfg, BATCH_SIZE, batch_seed(seed, rank, step))
        measure = track_memory and step == memory_step(steps)
        for name, module, opt in (("rtp", gm, rtp_opt), ("ddp", ddp, ddp_opt)):
            loss, seconds, peak = _train_step(module, opt, idx, targets, measure)
            out[f"{name}_loss"].append(loss)
            out[f"{name}_s"].append(seconds)
            if measure:
                out[f"{name}_peak"] = peak
    return out


def run_demo(world_size: int = 2, steps: int = 60, seed: int = 0, log_every: int = 10, *,
             track_memory: bool = True, timeout: float = 300.0) -> dict:
    """Train TinyGPT with RTP and DDP side by side on `world_size` CPU ranks; print and return.

    The returned dict holds, per step, the RTP and DDP losses averaged over ranks
    (`rtp_loss`, `ddp_loss`), the 1-based steps printed (`logged_steps`), per rank the
    parameter bytes (`rtp_param_bytes`, `ddp_param_bytes`) and the MemTracker peak of one
    step (`rtp_peak_bytes`, `ddp_peak_bytes`, None without `track_memory`), the median
    seconds per step (`rtp_step_s`, `ddp_step_s`, `step_time_ratio`) and `max_loss_diff`
    (largest |RTP - DDP| loss over all steps).
    """
    if steps < 1 or log_every < 1:
        raise ValueError(f"run_demo: steps and log_every must be >= 1, got {steps}, {log_every}")
    torch.manual_seed(seed)
    model = TinyGPT()
    ranks = launch(_rank_job, world_size, args=(model, steps, seed, track_memory),
                   timeout=timeout)
    result = _summarise(model, world_size, steps, seed, log_every, ranks)
    print(format_result(result))
    return result


def _summarise(model: TinyGPT, world_size: int, steps: int, seed: int, log_every: int,
               ranks: list[dict]) -> dict:
    """Fold the ranks' records into the demo's result: means over ranks, per-rank lists."""
    def mean_over_ranks(key):
        return [statistics.fmean(r[key][i] for r in ranks) for i in range(steps)]

    rtp_loss, ddp_loss = mean_over_ranks("rtp_loss"), mean_over_ranks("ddp_loss")
    rtp_step_s = statistics.median(mean_over_ranks("rtp_s"))  # median: skips warm-up and tracking
    ddp_step_s = statistics.median(mean_over_ranks("ddp_s"))
    return {
        "world_size": world_size, "steps": steps, "seed": seed,
        "config": model.cfg, "n_params": sum(p.numel() for p in model.parameters()),
        "logged_steps": sorted({1, steps, *range(log_every, steps + 1, log_every)}),
        "rtp_loss": rtp_loss, "ddp_loss": ddp_loss,
        "max_loss_diff": max(abs(a - b) for a, b in zip(rtp_loss, ddp_loss)),
        "rtp_param_bytes": [r["rtp_param_bytes"] for r in ranks],
        "ddp_param_bytes": [r["ddp_param_bytes"] for r in ranks],
        "rtp_peak_bytes": [r["rtp_peak"] for r in ranks],
        "ddp_peak_bytes": [r["ddp_peak"] for r in ranks],
        "rtp_step_s": rtp_step_s, "ddp_step_s": ddp_step_s,
        "step_time_ratio": rtp_step_s / ddp_step_s,
    }


def format_result(result: dict) -> str:
    """The demo's printout: header, loss table, memory table, timing line."""
    cfg, n, steps = result["config"], result["world_size"], result["steps"]
    rtp_loss, ddp_loss = result["rtp_loss"], result["ddp_loss"]
    losses = format_table([["step", "rtp loss", "ddp loss", "|diff|"],
                           *[[s, f"{rtp_loss[s - 1]:.6f}", f"{ddp_loss[s - 1]:.6f}",
                              f"{abs(rtp_loss[s - 1] - ddp_loss[s - 1]):.2e}"]
                             for s in result["logged_steps"]]])
    lines = [
        f"TinyGPT: {result['n_params']:,} parameters ({cfg.n_layer} layers, d_model {cfg.n_embd}, "
        f"{cfg.n_head} heads, vocab {cfg.vocab_size}, context {cfg.block_size}), float32",
        f"world size {n}: RTP (each rank holds 1/{n} of every weight) vs DDP (every rank holds "
        f"all); {steps} AdamW steps, lr {LR:g}, {BATCH_SIZE} sequences per rank",
        "",
        losses,
        f"losses are means over ranks; max |rtp - ddp| over all {steps} steps: "
        f"{result['max_loss_diff']:.2e}",
        "",
        _memory_table(result),
    ]
    if _has_peaks(result):
        lines.append(f"peak step bytes: MemTracker peak of step {memory_step(steps) + 1} "
                     "(parameters, gradients, optimizer state, activations, temporaries)")
    lines += [
        "",
        f"time per step (median): rtp {result['rtp_step_s'] * 1e3:.1f} ms, "
        f"ddp {result['ddp_step_s'] * 1e3:.1f} ms, ratio rtp/ddp {result['step_time_ratio']:.2f}",
    ]
    return "\n".join(lines)


def _memory_table(result: dict) -> str:
    """Per rank: parameter bytes of RTP and DDP, and the MemTracker peak of a step if measured."""
    peaks = _has_peaks(result)
    headers = ["rank", "RTP param bytes", "DDP param bytes", "ratio"]
    if peaks:
        headers += ["RTP peak step bytes", "DDP peak step bytes", "ratio"]
    rows = []
    for rank in range(result["world_size"]):
        rtp, ddp = result["rtp_param_bytes"][rank], result["ddp_param_bytes"][rank]
        row = [rank, f"{rtp:,}", f"{ddp:,}", f"{rtp / ddp:.3f}"]
        if peaks:
            rtp_peak, ddp_peak = result["rtp_peak_bytes"][rank], result["ddp_peak_bytes"][rank]
            row += [f"{rtp_peak:,}", f"{ddp_peak:,}", f"{rtp_peak / ddp_peak:.3f}"]
        rows.append(row)
    return format_table([headers, *rows])


def _has_peaks(result: dict) -> bool:
    """Whether the peak memory of a step was measured on every rank."""
    return None not in result["rtp_peak_bytes"] + result["ddp_peak_bytes"]
