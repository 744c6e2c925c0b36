"""The project's main job: train TinyGPT on Shakespeare with Rotated Tensor Parallelism next to a
DDP replica, then let the trained model write.

`run_demo` spawns `world_size` CPU ranks with `rtp_compile.launch`. Every rank reads the text
shipped in the package (`rtp_compile.apps.corpus`: characters, the last tenth held out) and trains
two copies of one initial model on the same per-rank batches with the same AdamW settings: the
rank's RTP program (1/N of every weight) and a DistributedDataParallel replica (every weight).
Both compute the same math, so their losses should agree. Rank 0 shows a progress bar; at the
end the program's full state is gathered (`prog.full_state_dict`) into an unsharded TinyGPT on
rank 0, which reports the held-out loss and samples a short text. The demo prints the losses
side by side, the per-rank parameter bytes of each, the measured peak memory of a step, tokens
per second and the time per step, the sample, and returns the numbers.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rtp_compile.apps.corpus import (
    TEXT_FILE,
    TextBatches,
    decode,
    encode,
    load_text,
    split,
    windows,
)
from rtp_compile.apps.models import GPTConfig, TinyGPT, generate, lm_loss
from rtp_compile.compiler.transform import transform
from rtp_compile.core.tables import format_table
from rtp_compile.runtime.launch import launch

# Model state dominates the activations of a step (as in the models RTP is for): 4 blocks x 256
# wide, 3.2 M parameters (51 MB of fp32 state with AdamW's), 4 sequences of 32 per rank.
MODEL = GPTConfig(n_layer=4, n_head=4, n_embd=256)
BATCH_SIZE = 4  # sequences per rank per step
LR = 1e-3
STEPS = 400  # the default: about a minute on 2 CPU cores at world size 2
PROMPT = "MENENIUS:\n"  # the sample continues this (a speaker of the text)
SAMPLE_CHARS = 300
TEMPERATURE = 0.8
EARLY_STEPS = 10  # float32 RTP and DDP losses agree to rounding this long (then AdamW amplifies it)


def param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters `module` holds (a tied parameter counts once)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, idx, targets, track_memory: bool
) -> tuple[float, float, int | None]:
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


def log_every(steps: int) -> int:
    """The interval of the loss table: the smallest of 1, 2, 5, 10, 20, 50, ... that prints at
    most 10 rows besides the first step."""
    for power in itertools.count():
        for mantissa in (1, 2, 5):
            if steps <= 10 * mantissa * 10**power:
                return mantissa * 10**power
    raise AssertionError("unreachable")


@torch.no_grad()
def held_out_loss(model: nn.Module, tokens: torch.Tensor, batch_size: int = 128) -> float:
    """Mean next-character loss of an unsharded model over all non-overlapping windows of
    `tokens` (the held-out text)."""
    inputs, targets = windows(tokens, model.cfg.block_size)
    was_training = model.training
    model.eval()
    total = sum(
        lm_loss(model(inputs[i : i + batch_size]), targets[i : i + batch_size]).item()
        * len(inputs[i : i + batch_size])
        for i in range(0, len(inputs), batch_size)
    )
    model.train(was_training)
    return total / len(inputs)


class _Progress:
    """Rank 0's tqdm bar over the steps: RTP loss of the step and RTP tokens/s of all ranks."""

    def __init__(self, start: int, steps: int, tokens_per_step: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=steps,
                initial=start,
                desc="training",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.1 if sys.stderr.isatty() else 5.0,
            )  # logs: fewer lines
        self.tokens_per_step = tokens_per_step
        self.recent = collections.deque(maxlen=20)  # RTP seconds of the last steps

    def update(self, loss: float, rtp_seconds: float) -> None:
        if self.bar is None:
            return
        self.recent.append(rtp_seconds)
        rate = self.tokens_per_step / statistics.fmean(self.recent)
        self.bar.set_postfix_str(f"rtp loss {loss:.3f}, rtp {rate:,.0f} tok/s", refresh=False)
        self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _rank_job(
    rank: int,
    world_size: int,
    model: TinyGPT,
    steps: int,
    seed: int,
    track_memory: bool,
    progress: bool,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
) -> dict:
    """Runs on each rank: train the RTP program and a DDP replica side by side on the text;
    on rank 0, also the held-out losses, the parameters' distance and the sample. With
    `checkpoint_dir`, both are saved every `checkpoint_every` steps (RTP with
    `rtp_compile.checkpoint` to <dir>/rtp, DDP with DCP to <dir>/ddp); `resume` starts from
    there."""
    train_tokens, held_tokens = split(encode(load_text()))
    out = {
        "rtp_loss": [],
        "ddp_loss": [],
        "rtp_s": [],
        "ddp_s": [],
        "rtp_peak": None,
        "ddp_peak": None,
    }
    if rank == 0:
        out["held_out_before"] = held_out_loss(model, held_tokens)
    ddp = DistributedDataParallel(copy.deepcopy(model))
    # Every rank compiles the same model itself (what a pickled program does too).
    prog = transform(model, world_size)
    gm = prog.module(rank)
    rtp_opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    out["rtp_param_bytes"], out["ddp_param_bytes"] = param_bytes(gm), param_bytes(ddp.module)
    batches = TextBatches(train_tokens, model.cfg.block_size, BATCH_SIZE, rank, world_size, seed)

    # The training state: both models and optimizers, the step, the batches' position, and
    # what was recorded so far. The batches of a step depend only on the seed and the position.
    step = 0
    if resume:
        step = _load(checkpoint_dir, gm, rtp_opt, ddp, ddp_opt, batches, out)
    bar = _Progress(
        step, steps, world_size * BATCH_SIZE * model.cfg.block_size, progress and rank == 0
    )
    start = time.perf_counter()
    while step < steps:
        idx, targets = batches.next_batch()
        measure = track_memory and step == memory_step(steps)
        for name, module, opt in (("rtp", gm, rtp_opt), ("ddp", ddp, ddp_opt)):
            loss, seconds, peak = _train_step(module, opt, idx, targets, measure)
            out[f"{name}_loss"].append(loss)
            out[f"{name}_s"].append(seconds)
            if measure:
                out[f"{name}_peak"] = peak
        step += 1
        bar.update(out["rtp_loss"][-1], out["rtp_s"][-1])
        if checkpoint_dir and checkpoint_every and step % checkpoint_every == 0:
            _save(checkpoint_dir, step, gm, rtp_opt, ddp, ddp_opt, batches, out)
    bar.close()
    out["train_s"] = time.perf_counter() - start

    full = prog.full_state_dict(gm)  # collective: every rank takes part
    if rank == 0:
        trained = copy.deepcopy(ddp.module)
        trained.load_state_dict(full)
        out["held_out_rtp"] = held_out_loss(trained, held_tokens)
        out["held_out_ddp"] = held_out_loss(ddp.module, held_tokens)
        reference = ddp.module.state_dict()
        out["max_param_diff"] = max((full[k] - reference[k]).abs().max().item() for k in full)
        out["sample"] = decode(
            generate(trained, encode(PROMPT), SAMPLE_CHARS, temperature=TEMPERATURE, seed=seed)
        )
    return out


def _save(directory: str, step: int, gm, rtp_opt, ddp, ddp_opt, batches, out: dict) -> None:
    """Collective: the RTP program's checkpoint (its shards; the step, this rank's batch
    position and records as `extra`) and DDP's, each a standard DCP directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rtp_compile.state import dcp as checkpoint

    checkpoint.save(
        f"{directory}/rtp",
        gm,
        rtp_opt,
        extra={"step": step, "batches": batches.state_dict(), "out": out},
    )
    model_state, optim_state = get_state_dict(ddp, ddp_opt)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=f"{directory}/ddp")


def _load(directory: str, gm, rtp_opt, ddp, ddp_opt, batches, out: dict) -> int:
    """Collective: what `_save` wrote, back into both models, optimizers, the batches and the
    records; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from rtp_compile.state import dcp as checkpoint

    extra = checkpoint.load(f"{directory}/rtp", gm, rtp_opt)
    model_state, optim_state = get_state_dict(ddp, ddp_opt)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=f"{directory}/ddp")
    set_state_dict(
        ddp, ddp_opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    batches.load_state_dict(extra["batches"])
    out.update({k: v for k, v in extra["out"].items() if k != "held_out_before"})
    return extra["step"]


def run_demo(
    world_size: int = 2,
    steps: int = STEPS,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    track_memory: bool = True,
    progress: bool = True,
    timeout: float | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 100,
    resume: bool = False,
) -> dict:
    """Train TinyGPT on the shipped Shakespeare text with RTP and DDP side by side on
    `world_size` CPU ranks; print and return.

    The returned dict holds, per step, the RTP and DDP losses averaged over ranks
    (`rtp_loss`, `ddp_loss`), the 1-based steps printed (`logged_steps`), per rank the
    parameter bytes (`rtp_param_bytes`, `ddp_param_bytes`) and the MemTracker peak of one
    step (`rtp_peak_bytes`, `ddp_peak_bytes`, None without `track_memory`), the median
    seconds per step (`rtp_step_s`, `ddp_step_s`, `step_time_ratio`), tokens per second of all
    ranks (`rtp_tokens_per_s`, `ddp_tokens_per_s`), `max_loss_diff` (largest |RTP - DDP| loss
    over all steps; `early_loss_diff`: over the first EARLY_STEPS), the held-out loss of the
    initial model and of the trained RTP and DDP models (`held_out_before`, `held_out_rtp`,
    `held_out_ddp`), the largest difference of a gathered RTP parameter from DDP's
    (`max_param_diff`), the text sampled from the trained RTP model (`sample`, starting with
    PROMPT) and the wall seconds of the training loop (`train_s`). `dtype` is the model's
    (float32, or float64 to compare RTP with DDP to rounding over a whole run). `progress` shows
    rank 0's progress bar on stderr. `timeout` bounds the job (default 300 s plus 1 s a step).
    `checkpoint_dir`: save both models every `checkpoint_every` steps there; `resume`: continue
    from the checkpoint there up to `steps` in all (the records of the steps before it come
    back with it).
    """
    if resume and not checkpoint_dir:
        raise ValueError("run_demo: resume needs the checkpoint_dir to resume from")
    if steps < 1:
        raise ValueError(f"run_demo: steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    model = TinyGPT(MODEL).to(dtype)
    print(format_header(model, world_size, steps), flush=True)
    ranks = launch(
        _rank_job,
        world_size,
        args=(model, steps, seed, track_memory, progress, checkpoint_dir, checkpoint_every, resume),
        timeout=300.0 + steps if timeout is None else timeout,
    )
    result = _summarise(model, world_size, steps, seed, ranks)
    print(format_result(result), flush=True)
    return result


def _summarise(model: TinyGPT, world_size: int, steps: int, seed: int, ranks: list[dict]) -> dict:
    """Fold the ranks' records into the demo's result: means over ranks, per-rank lists."""

    def mean_over_ranks(key):
        return [statistics.fmean(r[key][i] for r in ranks) for i in range(steps)]

    rtp_loss, ddp_loss = mean_over_ranks("rtp_loss"), mean_over_ranks("ddp_loss")
    rtp_step_s = statistics.median(mean_over_ranks("rtp_s"))  # median: skips warm-up and tracking
    ddp_step_s = statistics.median(mean_over_ranks("ddp_s"))
    tokens_per_step = world_size * BATCH_SIZE * model.cfg.block_size
    every = log_every(steps)
    return {
        "world_size": world_size,
        "steps": steps,
        "seed": seed,
        "config": model.cfg,
        "n_params": sum(p.numel() for p in model.parameters()),
        "logged_steps": sorted({1, steps, *range(every, steps + 1, every)}),
        "rtp_loss": rtp_loss,
        "ddp_loss": ddp_loss,
        "max_loss_diff": max(abs(a - b) for a, b in zip(rtp_loss, ddp_loss)),
        "early_loss_diff": max(
            abs(a - b) for a, b in zip(rtp_loss[:EARLY_STEPS], ddp_loss[:EARLY_STEPS])
        ),
        "dtype": str(model.wte.weight.dtype).removeprefix("torch."),
        "rtp_param_bytes": [r["rtp_param_bytes"] for r in ranks],
        "ddp_param_bytes": [r["ddp_param_bytes"] for r in ranks],
        "rtp_peak_bytes": [r["rtp_peak"] for r in ranks],
        "ddp_peak_bytes": [r["ddp_peak"] for r in ranks],
        "rtp_step_s": rtp_step_s,
        "ddp_step_s": ddp_step_s,
        "step_time_ratio": rtp_step_s / ddp_step_s,
        "tokens_per_step": tokens_per_step,
        "rtp_tokens_per_s": tokens_per_step / rtp_step_s,
        "ddp_tokens_per_s": tokens_per_step / ddp_step_s,
        "train_s": max(r["train_s"] for r in ranks),
        **{
            key: ranks[0][key]
            for key in (
                "held_out_before",
                "held_out_rtp",
                "held_out_ddp",
                "max_param_diff",
                "sample",
            )
        },
    }


def format_header(model: TinyGPT, world_size: int, steps: int) -> str:
    """What the demo trains, printed before it starts."""
    cfg, n = model.cfg, world_size
    n_params = sum(p.numel() for p in model.parameters())
    n_chars = len(load_text())
    return "\n".join(
        [
            f"TinyGPT: {n_params:,} parameters ({cfg.n_layer} layers, d_model {cfg.n_embd}, "
            f"{cfg.n_head} heads, vocab {cfg.vocab_size}, context {cfg.block_size}), "
            f"{str(model.wte.weight.dtype).removeprefix('torch.')}",
            f"text: Shakespeare (rtp_compile/apps/data/{TEXT_FILE}), {n_chars:,} characters, "
            "one token each; the last 10% held out",
            f"world size {n}: RTP (each rank holds 1/{n} of every weight) vs DDP (every rank holds "
            f"all); {steps} AdamW steps, lr {LR:g}, {BATCH_SIZE} sequences per rank",
        ]
    )


def format_result(result: dict) -> str:
    """The demo's printout after training: loss table, held-out loss, memory table, speed,
    the sample."""
    steps = result["steps"]
    early = min(steps, EARLY_STEPS)
    rtp_loss, ddp_loss = result["rtp_loss"], result["ddp_loss"]
    losses = format_table(
        [
            ["step", "rtp loss", "ddp loss", "|diff|"],
            *[
                [
                    s,
                    f"{rtp_loss[s - 1]:.6f}",
                    f"{ddp_loss[s - 1]:.6f}",
                    f"{abs(rtp_loss[s - 1] - ddp_loss[s - 1]):.2e}",
                ]
                for s in result["logged_steps"]
            ],
        ]
    )
    lines = [
        "",
        losses,
        f"losses are means over ranks; max |rtp - ddp| over the first {early} steps "
        f"{result['early_loss_diff']:.2e}, over all {steps}: {result['max_loss_diff']:.2e}",
        *_drift_note(result),
        f"held-out loss (the last 10% of the text): {result['held_out_before']:.4f} before "
        f"training; after: rtp {result['held_out_rtp']:.4f}, ddp {result['held_out_ddp']:.4f}",
        "",
        _memory_table(result),
    ]
    if _has_peaks(result):
        lines.append(
            f"peak step bytes: MemTracker peak of step {memory_step(steps) + 1} "
            "(parameters, gradients, optimizer state, activations, temporaries)"
        )
    lines += [
        "",
        f"tokens/s (all {result['world_size']} ranks, {result['tokens_per_step']:,} tokens a "
        f"step): rtp {result['rtp_tokens_per_s']:,.0f}, ddp {result['ddp_tokens_per_s']:,.0f}; "
        f"{steps} steps of both in {result['train_s']:.1f} s",
        f"time per step (median): rtp {result['rtp_step_s'] * 1e3:.1f} ms, "
        f"ddp {result['ddp_step_s'] * 1e3:.1f} ms, ratio rtp/ddp {result['step_time_ratio']:.2f}",
        "",
        f"sample from the trained RTP model (gathered on rank 0; temperature {TEMPERATURE:g}, "
        f"seed {result['seed']}):",
        result["sample"],
    ]
    return "\n".join(lines)


def _drift_note(result: dict) -> list[str]:
    """Why float32 losses drifted apart after the first steps, if they did."""
    if result["dtype"] != "float32" or result["max_loss_diff"] <= 1e-4:
        return []
    return [
        "float32: the two runs add up gradients in different orders, and AdamW amplifies the",
        "rounding until they drift apart while training alike; --dtype float64 shows them",
        "agree to rounding over the whole run",
    ]


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
