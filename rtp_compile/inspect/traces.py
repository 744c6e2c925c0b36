"""One training step per rank recorded with torch.profiler, saved as chrome traces (they open
in Perfetto, ui.perfetto.dev): what `rtp_compile.timeline` plots and `rtp-compile bench`
counts messages in.

    paths = rtp_compile.record_traces(make_step, world_size=2, out_dir="traces")
    rtp_compile.timeline(paths, "timeline.png")

`make_step(rank, world_size, *args)` runs on every rank of a local job (`rtp_compile.launch`)
and returns a function that trains one step; it is warmed up, then profiled once.
`apps.models.lm_step` is one for language models such as `apps.models.TinyGPT`:

    rtp_compile.record_traces(lm_step, 2, "traces", args=(prog, vocab_size, batch, seq_len))
"""

from __future__ import annotations

import json
import pathlib

import torch.distributed as dist

from rtp_compile.runtime.launch import launch

STEP = "rtp.step"  # the profiler range a recorded step runs in


def profile_step(step, path, cuda: bool = False, record_shapes: bool = False):
    """Run `step()` once under torch.profiler, inside a `rtp.step` range (CUDA activity too
    if `cuda`), and save its chrome trace to `path`. Returns (what `step` returned, the
    trace's events)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        with record_function(STEP):
            result = step()
    prof.export_chrome_trace(str(path))
    return result, json.loads(pathlib.Path(path).read_text())["traceEvents"]


def record_traces(
    make_step, world_size: int, out_dir, args=(), warmup: int = 1, timeout: float = 300.0
) -> list[pathlib.Path]:
    """On `world_size` local ranks, build each rank's step with `make_step(rank, world_size,
    *args)`, run it `warmup` times, then once under the profiler; each rank saves
    `out_dir/rank<r>.json`, and `out_dir/ranks.json` holds them all in one trace (one process
    per rank, on the host's one clock: Perfetto shows the ring). Returns the per-rank paths,
    in rank order."""
    return record_runs(make_step, world_size, out_dir, {"": tuple(args)}, warmup, timeout)[""]


def record_runs(
    make_step,
    world_size: int,
    out_dir,
    runs: dict[str, tuple],
    warmup: int = 1,
    timeout: float = 300.0,
) -> dict[str, list[pathlib.Path]]:
    """`record_traces` for several steps in one job (one start of the ranks): for each
    `name, args` of `runs`, in order, the step `make_step(rank, world_size, *args)` recorded
    into `out_dir/name`. Returns each name's per-rank paths."""
    out = pathlib.Path(out_dir)
    for name in runs:
        (out / name).mkdir(parents=True, exist_ok=True)
    paths = launch(
        _record_rank,
        world_size,
        args=(make_step, str(out), warmup, runs),
        timeout=timeout,
        env={"KINETO_LOG_LEVEL": "6"},
    )  # no profiler start/stop lines
    traces = {name: [pathlib.Path(p[name]) for p in paths] for name in runs}
    for name, ranks in traces.items():
        merge_traces(ranks, out / name / "ranks.json")
    return traces


def _record_rank(
    rank: int, world_size: int, make_step, out: str, warmup: int, runs: dict[str, tuple]
) -> dict[str, str]:
    paths = {}
    for name, args in runs.items():
        step = make_step(rank, world_size, *args)
        for _ in range(warmup):
            step()
        dist.barrier()  # every rank starts its profiled step together
        paths[name] = str(pathlib.Path(out) / name / f"rank{rank}.json")
        profile_step(step, paths[name])
    return paths


def merge_traces(paths, out) -> pathlib.Path:
    """One chrome trace of several ranks' traces (`paths` in rank order): rank r's events
    as process r, named "rank r". Returns `out`."""
    events = []
    for rank, path in enumerate(paths):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for event in json.loads(pathlib.Path(path).read_text())["traceEvents"]:
            if event.get("ph") != "M":  # each rank's own process and thread names
                events.append({**event, "pid": rank})
    pathlib.Path(out).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return pathlib.Path(out)
