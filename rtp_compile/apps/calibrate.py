"""A hardware description of this machine for the time model, from short micro-benchmarks.

Per world size N, one job of N local processes (`launch`: gloo on CPU, one torch thread per
process) measures with every rank running at once, as in the training benchmarks
(`rtp_compile.apps.bench_speed`): the FLOP/s of small-GPT matmuls, the bytes/s of an elementwise
op, the seconds of one small eager op with autograd, and the four communications the plans use
(a ring hop, all-reduce, all-gather, reduce-scatter), each fitted as seconds = a + b * bytes over
message sizes of 4 KiB .. 16 MiB. Then one fresh process (a `fake` process group: communication
free) times a rank module of plain Linear layers against the unsharded model: the runtime's own
seconds per unit-step. Compute numbers are medians of timed repeats after warm-up, the
communication fits go through the means (stalls included: a step sums many messages, and
gloo's waits here take ~4 ms now and then); the median over ranks. The notes say how well each
line fits, how many calls stalled (over 2 ms), the lines through the medians, and how much of
the cores other processes used meanwhile (from /proc/stat).

    rtp-compile calibrate [--world-sizes 2 4] [--out benchmarks/out/hardware-this-cpu.json]
                          [--name this-cpu] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rtp_compile.core.tables import format_table
from rtp_compile.runtime.launch import launch

DEFAULT_OUT = "benchmarks/out/hardware-this-cpu.json"
KIB, MIB = 1024, 1024 * 1024
MATMUL_SHAPES = [(512, 384, 1152), (512, 384, 384), (512, 1536, 384)]  # M, K, N of a small GPT
STALL_S = 2e-3  # a communication call this slow waited for something (gloo here: ~4 ms)
BANDWIDTH_BYTES = 16 * MIB  # each of the elementwise op's three tensors
OP_CHAIN = 64  # tiny ops per forward of the dispatch measurement
BLOCK = dict(n_embd=384, n_head=8, block_size=128)  # the block factors' block: gpt-small's
BLOCK_BATCH = 4
COMPUTE = (  # matmul_flops (per dtype) first, then the scalar rates
    "matmul_flops",
    "memory_bandwidth",
    "op_overhead_s",
    "backward_factor",
    "compute_factor",
)
RUNTIME = ("rtp_step_overhead_s", "fsdp_block_overhead_s", "fsdp_optimizer_overhead_s")
COMMS = ("ring_hop", "all_reduce", "all_gather", "reduce_scatter")
LAYERS, WIDTH, BATCH = 4, 64, 16  # the runtime overhead's model: LAYERS x Linear(WIDTH, WIDTH)


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much to measure: message sizes, rounds x timed repeats (after `warmup` untimed ones
    in the first round) of each communication, repeats of each compute op, and rounds x steps
    of the runtime overhead."""

    sizes: tuple[int, ...]
    rounds: int
    repeats: int
    warmup: int
    compute_repeats: int
    overhead_rounds: int
    overhead_steps: int


FULL = Settings(
    sizes=tuple(4 * KIB * 4**i for i in range(7)),  # 4 KiB .. 16 MiB (DDP's buckets: 25)
    rounds=10,
    repeats=10,
    warmup=3,
    compute_repeats=20,
    overhead_rounds=6,
    overhead_steps=20,
)
QUICK = Settings(
    sizes=(4 * KIB, 64 * KIB, 1 * MIB),
    rounds=2,
    repeats=4,
    warmup=2,
    compute_repeats=3,
    overhead_rounds=2,
    overhead_steps=5,
)


def _times(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _times_after_compute(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """`_times`, each call issued after about a millisecond of untimed compute (matmuls), as
    training issues its messages: on this VM a gloo call right after compute costs ~1 ms more
    than one in a tight loop of calls (threads woken), which is what a step pays."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        for _ in range(BETWEEN_MATMULS):
            torch.mm(a, b)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


BETWEEN_MATMULS = 3  # 256^3 each: ~0.35 ms on this machine


def _median_time(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median seconds of `repeats` calls of `fn` after `warmup` untimed ones."""
    return statistics.median(_times(fn, repeats, warmup))


def _matmul_flops(dtype: torch.dtype, s: Settings) -> float:
    """FLOP/s (2*M*K*N per matmul) of the small-GPT shapes together: their FLOPs over the sum
    of their median times (what a model of such matmuls gets, not the best shape's rate)."""
    flops = seconds = 0.0
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        c = torch.empty(m, n, dtype=dtype)
        seconds += _median_time(lambda: torch.mm(a, b, out=c), s.compute_repeats, 2)
        flops += 2 * m * k * n
    return flops / seconds


def _memory_bandwidth(s: Settings) -> float:
    """Bytes/s of `torch.add(a, b, out=c)` on float32 tensors: two read, one written."""
    a, b, c = (torch.randn(BANDWIDTH_BYTES // 4) for _ in range(3))
    seconds = _median_time(lambda: torch.add(a, b, out=c), s.compute_repeats, 2)
    return 3 * BANDWIDTH_BYTES / seconds


def _op_overhead(s: Settings) -> float:
    """Seconds per tiny eager op with autograd: forward and backward of a chain of OP_CHAIN ops
    (and the sum) on a 1 x 8 tensor that requires grad, divided by the forward's ops."""
    x = torch.randn(1, 8, requires_grad=True)

    def chain() -> None:
        y = x
        for i in range(OP_CHAIN):
            y = y * 1.001 if i % 2 else y + 0.001
        y.sum().backward()

    return _median_time(chain, 5 * s.compute_repeats, 5) / (OP_CHAIN + 1)


def _block_factors(s: Settings, compute: dict) -> tuple[float, float]:
    """TinyGPT's block at BLOCK's shape, batch BLOCK_BATCH, autograd recording in both:
    (its backward time over its forward's, what the time model multiplies each op's forward by:
    2 for a matmul alone, attention, norms and activations' backward more; its forward's time,
    less its ops' launches, over the roofline time of its ops (`cost.profile` on fake tensors,
    priced at `compute`, the rates just measured): what real kernels on these shapes lose
    against the rates)."""
    from rtp_compile.apps.models import Block, GPTConfig
    from rtp_compile.cost.hardware import Hardware, Level
    from rtp_compile.cost.profile import profile_forward

    torch.manual_seed(0)
    block = Block(GPTConfig(n_layer=1, **BLOCK))
    x = torch.randn(BLOCK_BATCH, BLOCK["block_size"], BLOCK["n_embd"], requires_grad=True)
    repeats = 3 * s.compute_repeats  # a few ms each; interleaved against drift
    forward_s: list[float] = []
    both_s: list[float] = []
    for _ in range(repeats):
        forward_s += _times(lambda: block(x), 1, 1)
        both_s += _times(lambda: block(x).sum().backward(), 1, 1)
    forward, both = statistics.median(forward_s), statistics.median(both_s)
    gm = torch.fx.symbolic_trace(block)
    ops = profile_forward(
        gm, dict(gm.named_parameters()), {"x": (tuple(x.shape), x.dtype)}, False
    ).ops
    rates = Hardware("calibrating", "", compute, (Level("-", None, 0.0, 1.0),), {}).rates(1)
    roofline = sum(rates.roofline(o.flops, o.bytes, o.itemsize) for o in ops)
    launches = len(ops) * rates.op_overhead_s
    return max(both - forward, 0.0) / forward, max(forward - launches, 0.0) / roofline


def _comm_fn(op: str, nbytes: int, rank: int, world_size: int) -> tuple[Callable[[], None], int]:
    """One call of communication `op` with a float32 tensor of about `nbytes`, and the bytes
    it counts (a ring hop: the message; all-reduce: the tensor; all-gather: its output;
    reduce-scatter: its input; gathered and scattered tensors rounded to a multiple of N)."""
    numel = max(1, nbytes // 4)
    if op == "ring_hop":
        outgoing, received = torch.randn(numel), torch.empty(numel)
        dst, src = (rank + 1) % world_size, (rank - 1) % world_size

        def hop() -> None:  # as rtp_compile.runtime.ring sends a hop
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, outgoing, dst), dist.P2POp(dist.irecv, received, src)]
            )
            for work in works:
                work.wait()

        return hop, 4 * numel
    if op == "all_reduce":
        tensor = torch.randn(numel)
        return lambda: dist.all_reduce(tensor), 4 * numel
    full = max(world_size, numel // world_size * world_size)
    whole, part = torch.randn(full), torch.randn(full // world_size)
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(whole, part), 4 * full
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, whole), 4 * full
    raise ValueError(f"unknown communication {op!r}")


def measure_rank(rank: int, world_size: int, s: Settings) -> dict:
    """On every rank of a job at once: the compute numbers and, per communication, the median
    seconds at each message size ([[bytes, seconds], ...])."""
    torch.manual_seed(rank)
    out: dict = {"matmul_flops": {}}
    dist.barrier()
    stat, cpu = proc_stat(), time.process_time()  # what else ran meanwhile, in the end
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        dist.barrier()  # every rank computes at once, as in training
        try:
            out["matmul_flops"][name] = _matmul_flops(dtype, s)
        except RuntimeError:  # a dtype this build's CPU kernels lack
            pass
    dist.barrier()
    out["memory_bandwidth"] = _memory_bandwidth(s)
    dist.barrier()
    out["op_overhead_s"] = _op_overhead(s)
    dist.barrier()
    out["backward_factor"], out["compute_factor"] = _block_factors(s, out)
    # Rounds over every op and size, so that a stretch of stalls (gloo's calls here take ~4 ms
    # now and then, a tight loop of hops most: see the ring_hop note) is spread over them all.
    calls = {
        (op, nbytes): _comm_fn(op, nbytes, rank, world_size) for op in COMMS for nbytes in s.sizes
    }
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for r in range(s.rounds):
        for (op, nbytes), (call, _) in calls.items():
            repeats = 2 * s.repeats if op == "ring_hop" else s.repeats  # hops are cheap
            dist.barrier()  # then a barrier-free loop of compute and the op, as in a step
            times[op, nbytes] += _times_after_compute(call, repeats, s.warmup if r == 0 else 1)
    for op in COMMS:
        keys = [(op, nbytes) for nbytes in s.sizes]
        medians = [statistics.median(times[key]) for key in keys]
        out[op] = [[calls[key][1], median] for key, median in zip(keys, medians)]
        out[f"{op}_mean"] = [[calls[key][1], statistics.mean(times[key])] for key in keys]
        slow = sum(sum(t > STALL_S for t in times[key]) for key in keys)
        out[f"{op}_slow"] = slow / sum(len(times[key]) for key in keys)
    out["cpu_s"] = time.process_time() - cpu  # this rank's threads, gloo's included
    dist.barrier()
    out["stat"] = [stat, proc_stat()]
    return out


MIN_SECONDS_PER_BYTE = 1e-12  # a slope the sizes could not resolve: 1 TB/s, noted


def fit_line(points: Sequence[Sequence[float]]) -> tuple[float, float, list[str]]:
    """seconds = a + b * bytes through `points` ([bytes, seconds], ...), least squares on the
    relative error (weights 1 / seconds: the small messages decide a, the large ones b). A
    negative a is clamped to 0 with b refitted through the origin; a slope <= 0 (times that do
    not grow with the size) to MIN_SECONDS_PER_BYTE with a refitted. Returns a, b and what was
    clamped."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w2 = 1.0 / y**2
    design = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    notes = []
    if b <= 0:
        b_fixed = MIN_SECONDS_PER_BYTE
        a_fixed = max(0.0, float(np.sum(w2 * (y - b_fixed * x)) / np.sum(w2)))
        notes.append(
            f"fit a = {a:.3g} s, b = {b:.3g} s/B: the times do not grow with the size; "
            f"clamped to b = {b_fixed:g} s/B, a = {a_fixed:.3g} s"
        )
        a, b = a_fixed, b_fixed
    elif a < 0:
        b_origin = float(np.sum(w2 * x * y) / np.sum(w2 * x * x))
        notes.append(
            f"fit a = {a:.3g} s clamped to 0, b refitted through the origin: {b_origin:.3g} s/B"
        )
        a, b = 0.0, b_origin
    return float(a), float(b), notes


def _worst_residual(points: Sequence[Sequence[float]], a: float, b: float) -> float:
    """The largest |fit / measured - 1| over the points."""
    return max(abs((a + b * nbytes) / seconds - 1) for nbytes, seconds in points)


def measure_rtp_overhead(world_sizes: Sequence[int], s: Settings) -> dict[int, dict]:
    """In this process, one fake process group per N in turn (every hop and collective returns
    at once): forward + backward (no optimizer) of rank 0's module of LAYERS Linear layers
    against the unsharded model, interleaved rounds; per N the medians and the seconds per
    rotated unit-step, (rank - unsharded) / (rotated units * N)."""
    import copy

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rtp_compile.compiler.transform import transform

    torch.set_num_threads(1)  # as a launched rank
    results = {}
    for n in world_sizes:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
            # fuse=False: two Linear layers in a row would rotate as one FUSED (MLP) unit
            prog = transform(model, n, fuse=False)
            units = len([u for u in prog.plan.units if u.kind.name == "ROTATE"])
            if not units:
                raise RuntimeError(f"no rotated unit in the plan at N={n}: {prog.plan}")
            modules = {
                "unsharded": copy.deepcopy(model),
                "rank": prog.module(0),
                "fsdp2": _fully_sharded(copy.deepcopy(model), n),
            }
            x = torch.randn(BATCH, WIDTH)
            optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in modules.items()}

            def step(module: torch.nn.Module) -> None:
                module(x).sum().backward()

            def update(kind: str) -> None:
                optimizers[kind].step()

            times: dict[str, list[float]] = {k: [] for k in modules}
            updates: dict[str, list[float]] = {k: [] for k in modules}
            kinds = list(modules)
            for r in range(s.overhead_rounds):
                for kind in kinds[r % 3 :] + kinds[: r % 3]:
                    module = modules[kind]
                    times[kind].append(
                        _median_time(lambda: step(module), s.overhead_steps, 3 if r == 0 else 1)
                    )
                    updates[kind].append(_median_time(lambda: update(kind), s.overhead_steps, 1))
            rank_s, unsharded_s, fsdp_s = (
                statistics.median(times[k]) for k in ("rank", "unsharded", "fsdp2")
            )
            plain_opt, fsdp_opt = (statistics.median(updates[k]) for k in ("unsharded", "fsdp2"))
            tensors = len(list(model.parameters()))
            results[n] = {
                "units": units,
                "rank_s": rank_s,
                "unsharded_s": unsharded_s,
                "fsdp2_s": fsdp_s,
                "rtp_step_overhead_s": (rank_s - unsharded_s) / (units * n),
                "fsdp_block_overhead_s": max(fsdp_s - unsharded_s, 0.0) / (LAYERS + 1),
                "fsdp_optimizer_overhead_s": max(fsdp_opt - plain_opt, 0.0) / tensors,
            }
        finally:
            dist.destroy_process_group()
    return results


def _fully_sharded(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """FSDP2 as the bench applies it: `fully_shard` on every layer, then on the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _rtp_overhead_fresh(world_sizes: Sequence[int], quick: bool) -> dict[int, dict]:
    """`measure_rtp_overhead` in a fresh Python process (nothing else of this run's state)."""
    cmd = [sys.executable, "-m", "rtp_compile.apps.calibrate", "--overhead-only"]
    cmd += ["--world-sizes", *map(str, world_sizes)] + (["--quick"] if quick else [])
    # the same rtp_compile as this process's, wherever the working directory is
    package_root = str(pathlib.Path(__file__).resolve().parents[2])
    path = os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        raise RuntimeError(f"the runtime overhead measurement failed:\n{done.stderr}")
    return {int(n): r for n, r in json.loads(done.stdout.splitlines()[-1]).items()}


def _median_over_ranks(ranks: list[dict]) -> dict:
    """One rank-shaped dict: every number the median over the ranks; "other_work" the share
    of the cores that other processes used during the job."""
    out: dict = {
        "other_work": other_work(*ranks[0]["stat"], sum(r["cpu_s"] for r in ranks)),
        "matmul_flops": {
            dtype: statistics.median(r["matmul_flops"][dtype] for r in ranks)
            for dtype in ranks[0]["matmul_flops"]
            if all(dtype in r["matmul_flops"] for r in ranks)
        },
    }
    for key in COMPUTE[1:]:  # the scalar ones, after matmul_flops
        out[key] = statistics.median(r[key] for r in ranks)
    for op in COMMS:
        out[op] = [
            [ranks[0][op][i][0], statistics.median(r[op][i][1] for r in ranks)]
            for i in range(len(ranks[0][op]))
        ]
        out[f"{op}_mean"] = [
            [ranks[0][op][i][0], statistics.median(r[f"{op}_mean"][i][1] for r in ranks)]
            for i in range(len(ranks[0][op]))
        ]
        out[f"{op}_slow"] = statistics.mean(r[f"{op}_slow"] for r in ranks)
    return out


BUSY_WARNING = 0.1  # other work on this share of the cores makes the timings suspect


def proc_stat() -> tuple[int, int] | None:
    """The machine's CPU time so far, all cores, in clock ticks: (total, idle + iowait), from
    /proc/stat; None where there is none."""
    try:
        fields = [int(v) for v in pathlib.Path("/proc/stat").read_text().split()[1:11]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]), fields[3] + fields[4]  # guest time is in user already


def other_work(before, after, own_cpu_s: float) -> float | None:
    """The share of all cores that processes other than ours (`own_cpu_s` CPU seconds) kept
    busy between two `proc_stat` samples."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    busy_s = ((after[0] - before[0]) - (after[1] - before[1])) / ticks
    return max(0.0, busy_s - own_cpu_s) / ((after[0] - before[0]) / ticks)


def _reduce_scatter_note() -> str:
    """What FSDP2's reduce-scatter is on gloo in this torch, and what was measured for it."""
    measured = (
        "dist.reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "dist.reduce_scatter_tensor"
    )
    return (
        f"reduce_scatter: {measured}, the call FSDP2's default reduce-scatter makes "
        "(fsdp/_fully_shard/_fsdp_collectives.py); gloo has no reduce-scatter of its own: "
        f"in torch {torch.__version__} (profiled: c10d::_reduce_scatter_base_ -> "
        "aten::clone, gloo:all_reduce, aten::copy_; dist.reduce_scatter of a list the same) "
        "it clones the input, all-reduces all of it and copies out the rank's chunk, so it "
        "costs an all_reduce of the input's bytes and more"
    )


def run(
    world_sizes: Sequence[int] = (2, 4),
    out: str | os.PathLike = DEFAULT_OUT,
    name: str = "this-cpu",
    quick: bool = False,
) -> dict:
    """Measure every world size, write the hardware description JSON to `out`, print the
    table of what was measured and the path; return the dict written."""
    if not world_sizes or min(world_sizes) < 2:
        raise ValueError(f"world sizes must be >= 2 (the ring has a peer), got {world_sizes}")
    world_sizes = sorted(set(world_sizes))
    s = QUICK if quick else FULL
    start = time.perf_counter()
    notes: list[str] = []
    measured: dict[str, dict] = {}
    raw: dict[int, dict] = {}
    busy: dict[str, float | None] = {}
    for n in world_sizes:
        raw[n] = _median_over_ranks(launch(measure_rank, n, args=(s,), timeout=300))
        busy[f"N={n} job"] = raw[n]["other_work"]
    before, children = proc_stat(), resource.getrusage(resource.RUSAGE_CHILDREN)
    overhead = _rtp_overhead_fresh(world_sizes, quick)
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = done.ru_utime + done.ru_stime - children.ru_utime - children.ru_stime
    busy["runtime overhead"] = other_work(before, proc_stat(), own)
    for n in world_sizes:
        one = raw[n]
        entry: dict = {k: one[k] for k in COMPUTE}
        for op in COMMS:  # the means: a step's time is a sum of many, stalls included
            a, b, clamped = fit_line(one[f"{op}_mean"])
            entry[op] = [a, b]
            notes += [f"N={n} {op}: {c}" for c in clamped]
            median_a, median_b, _ = fit_line(one[op])
            notes.append(
                f"N={n} {op}: the means' fit within "
                f"{100 * _worst_residual(one[f'{op}_mean'], a, b):.0f}%; "
                f"{100 * one[f'{op}_slow']:.0f}% of the timed calls took over "
                f"{1e3 * STALL_S:g} ms; the medians (no stalls) fit a = {median_a:.3g} s, "
                f"b = {median_b:.3g} s/B"
            )
        step_s = overhead[n]["rtp_step_overhead_s"]
        if step_s <= 0:
            notes.append(f"N={n} rtp_step_overhead_s measured {step_s:.3g} s, clamped to 1e-9")
            step_s = 1e-9
        entry["rtp_step_overhead_s"] = step_s
        for key in RUNTIME[1:]:  # the first, clamped above
            entry[key] = overhead[n][key]
        measured[str(n)] = entry
    first = measured[str(world_sizes[0])]
    a, b = first["ring_hop"]
    notes += [
        f"every measurement with all N ranks running at once ({os.cpu_count()} cores; "
        "one torch thread per rank); compute: medians of timed repeats after warm-up; "
        "communication: means of timed repeats (stalls included); then the median over ranks",
        "matmul_flops: the FLOPs over the summed median times of [M, K] @ [K, N] for (M, K, N) in "
        f"{MATMUL_SHAPES}, 2*M*K*N flops; memory_bandwidth: torch.add(a, b, out=c) on "
        f"{BANDWIDTH_BYTES // MIB} MiB float32 tensors, 3 x {BANDWIDTH_BYTES // MIB} MiB per op; "
        "op_overhead_s: "
        f"forward + backward of a chain of {OP_CHAIN} mul/add ops and a sum on a 1 x 8 tensor "
        "requiring grad, per forward op; backward_factor: (forward + backward - forward) / "
        f"forward of TinyGPT's block {BLOCK}, batch {BLOCK_BATCH}, medians; compute_factor: "
        "that forward less its ops' launches over their roofline time at the rates above "
        "(cost.profile)",
        f"communication: gloo, float32, {s.sizes[0]} .. {s.sizes[-1]} bytes "
        f"({len(s.sizes)} sizes), [a s, b s/byte] of seconds = a + b * bytes, least squares on "
        "the relative error; bytes: ring_hop the message, all_reduce the tensor, all_gather "
        "the output (dist.all_gather_single), reduce_scatter the input",
        f"every communication timed after {BETWEEN_MATMULS} untimed 256^3 matmuls (as a step "
        "issues them after compute; a tight loop of calls is ~1 ms faster per call here); "
        "ring_hop: dist.batch_isend_irecv of an isend to rank+1 and an irecv from rank-1, both "
        "waited, their works then dropped (as rtp_compile.runtime.ring's wait), a barrier-free "
        "loop of hops; on this 2-core VM probes of such a loop (N = 2, 4 KiB) had 60-85% of "
        "the hops take ~4 ms, a share that hangs on fine timing: 6-10% where the previous "
        "hop's works stayed referenced until the next hop was issued, ~10% with timer calls "
        "between issue, wait and release (pipes and raw TCP between two processes: no stalls)",
        _reduce_scatter_note(),
        f"rtp_step_overhead_s: fake process group, rank 0, {LAYERS} x nn.Linear({WIDTH}, "
        f"{WIDTH}) (transform(..., fuse=False): {overhead[world_sizes[0]]['units']} ROTATE "
        f"units; fused, each two Linear layers are one FUSED unit), batch {BATCH} x "
        f"{WIDTH}, loss output.sum(), forward + backward, no optimizer; (rank - unsharded) / "
        "(units * N); "
        + "; ".join(
            f"N={n}: rank {1e3 * overhead[n]['rank_s']:.2f} ms, unsharded "
            f"{1e3 * overhead[n]['unsharded_s']:.2f} ms"
            for n in world_sizes
        ),
        "fsdp_block_overhead_s: the same layers under fully_shard (each, then the root) in the "
        "same fake group, (fsdp2 - unsharded) / (layers + 1), forward + backward; "
        "fsdp_optimizer_overhead_s: AdamW's step on those DTensor shards less on the unsharded "
        "layers, per parameter tensor",
        "other work on the machine (the share of the cores that processes other than "
        "calibrate's kept busy, from /proc/stat): "
        + ", ".join(f"{k} {'?' if v is None else f'{100 * v:.0f}%'}" for k, v in busy.items()),
        f"top-level compute, levels and runtime: N={world_sizes[0]}"
        + (" (--quick: few sizes and repeats)" if quick else ""),
        f"measured in {time.perf_counter() - start:.0f} s",
    ]
    hardware = {
        "name": name,
        "source": (
            f"rtp-compile calibrate, {socket.gethostname()}, "
            f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
            f"torch {torch.__version__}, {os.cpu_count()} cores"
        ),
        "cores": os.cpu_count(),
        "host_runs_ahead": False,  # eager on a CPU: an op runs when issued
        "overlap": False,  # gloo on one machine: the kernel copies a message on the sender's core
        "compute": {k: first[k] for k in COMPUTE},
        "levels": [{"name": "loopback (gloo)", "ranks": None, "latency_s": a, "bandwidth": 1 / b}],
        "runtime": {key: first[key] for key in RUNTIME},
        "measured": measured,
        "notes": notes,
    }
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    print(_table(measured, raw))
    crowded = {k: v for k, v in busy.items() if v is not None and v > BUSY_WARNING}
    if crowded:
        notes.append(
            "warning: other processes used the cores during the measurements ("
            + ", ".join(f"{k} {100 * v:.0f}%" for k, v in crowded.items())
            + "): the timings, communication's most, include waits for a core; "
            "calibrate on an idle machine"
        )
        print(notes[-1])
    path.write_text(json.dumps(hardware, indent=2) + "\n")
    print(f"hardware description written: {path}")
    return hardware


def _table(measured: dict[str, dict], raw: dict[int, dict]) -> str:
    """What was measured: a row per quantity, a column per world size."""
    ns = list(measured)
    rows: list[list] = [["quantity"] + [f"N={n}" for n in ns]]
    dtypes = sorted({d for m in measured.values() for d in m["matmul_flops"]})
    for dtype in dtypes:
        rows.append(
            [f"matmul {dtype} GFLOP/s"]
            + [_fmt(measured[n]["matmul_flops"].get(dtype), 1e-9) for n in ns]
        )
    rows.append(["memory GB/s"] + [_fmt(measured[n]["memory_bandwidth"], 1e-9) for n in ns])
    rows.append(["eager op us"] + [_fmt(measured[n]["op_overhead_s"], 1e6) for n in ns])
    rows.append(["backward / forward"] + [_fmt(measured[n]["backward_factor"], 1) for n in ns])
    rows.append(["block / roofline"] + [_fmt(measured[n]["compute_factor"], 1) for n in ns])
    for op in COMMS:
        rows.append([f"{op} latency us"] + [_fmt(measured[n][op][0], 1e6) for n in ns])
        rows.append([f"{op} GB/s (1/b)"] + [_fmt(1 / measured[n][op][1], 1e-9) for n in ns])
        for nbytes, _ in raw[int(ns[0])][op][:: max(1, len(raw[int(ns[0])][op]) // 3)]:
            rows.append(
                [f"  {op} {_bytes(nbytes)} ms, median / mean"]
                + [
                    f"{_at(raw[int(n)][op], nbytes)} / {_at(raw[int(n)][f'{op}_mean'], nbytes)}"
                    for n in ns
                ]
            )
        rows.append(
            [f"  {op} calls over {1e3 * STALL_S:g} ms"]
            + [f"{100 * raw[int(n)][f'{op}_slow']:.0f}%" for n in ns]
        )
    for key, label in (
        ("rtp_step_overhead_s", "rtp unit-step overhead us"),
        ("fsdp_block_overhead_s", "fsdp2 block overhead us"),
        ("fsdp_optimizer_overhead_s", "fsdp2 optimizer per tensor us"),
    ):
        rows.append([label] + [_fmt(measured[n][key], 1e6) for n in ns])
    return format_table(rows)


def _at(points: list[list], nbytes: int) -> str:
    """The milliseconds of the point at about `nbytes`."""
    return _fmt(next(t for b, t in points if _near(b, nbytes)), 1e3)


def _near(a: int, b: int) -> bool:
    """Byte counts of the same requested size (gathered tensors are rounded to N elements)."""
    return abs(a - b) <= 64


def _bytes(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def _fmt(value: float | None, scale: float) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    scaled = value * scale
    return f"{scaled:.3g}" if abs(scaled) < 100 else f"{scaled:.0f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--name", default="this-cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--overhead-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.overhead_only:  # the fresh process of `_rtp_overhead_fresh`: JSON on the last line
        result = measure_rtp_overhead(args.world_sizes, QUICK if args.quick else FULL)
        print(json.dumps(result))
        return result
    return run(args.world_sizes, args.out, args.name, args.quick)


if __name__ == "__main__":
    main()
