"""Per-rank timelines of one profiled training step: compute against ring communication.

`rtp_compile.timeline(traces, path=None)` reads one chrome trace per rank (`torch.profiler`;
e.g. from `rtp_compile.record_traces`) and finds, over the trace's `rtp.step` range (or all of
it), when each rank
- computes: inside an op (`cpu_op` events) and outside the ring's ranges,
- sends: in a `rtp.send ...` range (packing a hop and posting it),
- waits: in a `rtp.wait ...` range (blocked until a hop has arrived),
- has a hop in flight: from the start of a hop's send to the end of its wait (matched by the
  hop's name).
Overlap is the share of the in-flight time during which the rank computes: 1 means every hop
travelled behind compute, 0 that the rank did nothing else while it flew. One row per rank;
times on the clock of the one host the ranks ran on (local ranks share it).
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from dataclasses import dataclass, field

from rtp_compile.core.tables import format_table
from rtp_compile.inspect.traces import STEP

Intervals = list[tuple[float, float]]  # (start, end) in microseconds, sorted, disjoint


@dataclass
class RankTimeline:
    """One rank's step: its window and intervals (µs on the host's clock), and where its
    backward and optimizer step begin (`phases`, where the trace shows them)."""

    rank: int
    window: tuple[float, float]
    compute: Intervals
    send: Intervals
    wait: Intervals
    flight: Intervals
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return (self.window[1] - self.window[0]) * 1e-6

    compute_s = property(lambda self: _length(self.compute) * 1e-6, doc="seconds computing")
    send_s = property(lambda self: _length(self.send) * 1e-6, doc="seconds in rtp.send")
    wait_s = property(lambda self: _length(self.wait) * 1e-6, doc="seconds in rtp.wait")
    flight_s = property(
        lambda self: _length(self.flight) * 1e-6, doc="seconds with a hop in flight"
    )

    @property
    def overlap(self) -> float:
        """The share of the time a hop is in flight during which the rank computes (nan with
        no hop)."""
        flight = _length(self.flight)
        return _length(_intersect(self.flight, self.compute)) / flight if flight else float("nan")

    @property
    def exposed(self) -> float:
        """The share of the step spent waiting on hops."""
        return self.wait_s / self.step_s


@dataclass
class Timeline:
    """Every rank's `RankTimeline` and the figure that plots them (`figure.savefig(...)`;
    a notebook shows it with `display(tl.figure)`)."""

    ranks: list[RankTimeline]
    figure: object

    @property
    def overlap(self) -> list[float]:
        return [r.overlap for r in self.ranks]

    def __str__(self) -> str:
        rows = [
            (
                "rank",
                "step ms",
                "compute ms",
                "send ms",
                "wait ms",
                "in flight ms",
                "overlap",
                "exposed",
            )
        ]
        for r in self.ranks:
            rows.append(
                (
                    r.rank,
                    f"{r.step_s * 1e3:.1f}",
                    f"{r.compute_s * 1e3:.1f}",
                    f"{r.send_s * 1e3:.1f}",
                    f"{r.wait_s * 1e3:.1f}",
                    f"{r.flight_s * 1e3:.1f}",
                    f"{r.overlap:.0%}",
                    f"{r.exposed:.0%}",
                )
            )
        return (
            format_table(rows) + "\noverlap: share of the time a hop is in flight spent "
            "computing; exposed: share of the step spent waiting on hops"
        )


def timeline(trace_or_run, path=None) -> Timeline:
    """Plot one step per rank, compute against the ring's send, wait and in-flight intervals.

    `trace_or_run`: a chrome trace (its path, or a `torch.profiler.profile` after its run), or
    a list of them, one per rank in rank order (what `record_traces` returns). `path`: also
    save the figure there (its suffix picks the format). Returns the `Timeline` (per rank:
    intervals, overlap, exposed wait; `.figure`)."""
    sources = trace_or_run if isinstance(trace_or_run, (list, tuple)) else [trace_or_run]
    ranks = [rank_timeline(read_events(s), r) for r, s in enumerate(sources)]
    figure = plot(ranks)
    if path is not None:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    return Timeline(ranks, figure)


def read_events(source) -> list[dict]:
    """The events of a chrome trace: a path to one, or a `torch.profiler.profile` (exported
    to a temporary file)."""
    if hasattr(source, "export_chrome_trace"):
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "trace.json"
            source.export_chrome_trace(str(path))
            return read_events(path)
    try:
        return json.loads(pathlib.Path(source).read_text())["traceEvents"]
    except (OSError, TypeError, ValueError, KeyError) as err:
        raise ValueError(
            f"rtp_compile.timeline: expected a chrome trace (a path to its JSON, "
            f"or a torch.profiler.profile), got {source!r}: {err}"
        ) from err


def rank_timeline(events: list[dict], rank: int) -> RankTimeline:
    """One rank's intervals, from its trace's events, within its first `rtp.step` range (or
    all of the trace without one)."""
    ranges = [e for e in events if e.get("ph") == "X" and "dur" in e]
    step = next((e for e in ranges if e.get("name") == STEP), None)
    window = (
        (step["ts"], step["ts"] + step["dur"])
        if step
        else (min(e["ts"] for e in ranges), max(e["ts"] + e["dur"] for e in ranges))
    )
    inside = [e for e in ranges if window[0] <= e["ts"] <= window[1]]
    send = [e for e in inside if e["name"].startswith("rtp.send ")]
    wait = [e for e in inside if e["name"].startswith("rtp.wait ")]
    ring = _union(_spans(send) + _spans(wait))
    ops = _union(_spans([e for e in inside if e.get("cat") == "cpu_op"]))
    phases = {}
    for phase, prefix in (
        ("backward", "autograd::engine::evaluate_function"),
        ("optimizer", "Optimizer.step"),
    ):
        starts = [e["ts"] for e in inside if e["name"].startswith(prefix)]
        if starts:
            phases[phase] = min(starts)
    return RankTimeline(
        rank,
        window,
        _subtract(ops, ring),
        _union(_spans(send)),
        _union(_spans(wait)),
        _union(_flights(send, wait)),
        phases,
    )


def _spans(events: list[dict]) -> Intervals:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events]


def _flights(send: list[dict], wait: list[dict]) -> Intervals:
    """Each hop from the start of its send to the end of the first wait on it after that
    (matched by the hop's name: "rtp.send X" with "rtp.wait X")."""
    waits: dict[str, list[dict]] = {}
    for e in sorted(wait, key=lambda e: e["ts"]):
        waits.setdefault(e["name"].split(" ", 1)[1], []).append(e)
    flights = []
    for e in sorted(send, key=lambda e: e["ts"]):
        later = [w for w in waits.get(e["name"].split(" ", 1)[1], []) if w["ts"] >= e["ts"]]
        if later:
            waits[e["name"].split(" ", 1)[1]].remove(later[0])
            flights.append((e["ts"], later[0]["ts"] + later[0]["dur"]))
    return flights


def _union(spans: Intervals) -> Intervals:
    merged: Intervals = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    """Where both of two unions (`_union`) hold."""
    out = []
    for s1, e1 in a:
        for s2, e2 in b:
            if min(e1, e2) > max(s1, s2):
                out.append((max(s1, s2), min(e1, e2)))
    return _union(out)


def _subtract(a: Intervals, b: Intervals) -> Intervals:
    """`a` without `b` (both unions)."""
    out = []
    for start, end in a:
        for s, e in b:
            if e <= start or s >= end:
                continue
            if s > start:
                out.append((start, s))
            start = max(start, e)
        if start < end:
            out.append((start, end))
    return out


def _length(spans: Intervals) -> float:
    return sum(end - start for start, end in spans)


_LANES = {
    "flight": (0.22, 0.14, "#b39ddb", "hop in flight (send start -> wait end)"),
    "compute": (0.0, 0.26, "#1f77b4", "compute (ops outside the ring ranges)"),
    "send": (-0.24, 0.16, "#ff7f0e", "rtp.send (pack and post a hop)"),
    "wait": (-0.24, 0.16, "#d62728", "rtp.wait (blocked on a hop)"),
}


def plot(ranks: list[RankTimeline]):
    """The figure: one row per rank (rank 0 on top), each with its lanes (`_LANES`) against
    ms since the first rank's step began; dotted lines where backward and the optimizer
    step begin."""
    from matplotlib.patches import Patch

    from rtp_compile.inspect.draw import matplotlib_figure

    origin = min(r.window[0] for r in ranks)
    fig = matplotlib_figure()(figsize=(11, 0.9 + 1.0 * len(ranks)))
    ax = fig.add_subplot()
    for r in ranks:
        base = -r.rank
        for lane, (offset, height, colour, _) in _LANES.items():
            spans = [((s - origin) / 1e3, (e - s) / 1e3) for s, e in getattr(r, lane)]
            ax.broken_barh(spans, (base + offset - height / 2, height), color=colour, lw=0)
        for phase, at in r.phases.items():
            x = (at - origin) / 1e3
            ax.vlines(x, base - 0.4, base + 0.4, colors="black", linestyles=":", lw=0.8)
            ax.text(x, base + 0.42, phase, fontsize=7, va="bottom")
        ax.plot(
            [(w - origin) / 1e3 for w in r.window], [base - 0.38] * 2, "|-", color="grey", lw=0.6
        )
    ax.set_yticks(
        [-r.rank for r in ranks], [f"rank {r.rank}\noverlap {r.overlap:.0%}" for r in ranks]
    )
    ax.set_ylim(-len(ranks) + 0.4, 0.65)
    ax.set_xlabel("ms since the first rank's step began")
    ax.set_title(
        "one training step per rank: compute against the ring's hops", fontsize=10, loc="left"
    )
    ax.legend(
        handles=[Patch(color=c, label=text) for _, _, c, text in _LANES.values()],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        frameon=False,
    )
    fig.tight_layout()
    return fig
