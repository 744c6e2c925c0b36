"""Looking at programs and runs: `prog.draw` writes a readable SVG/PNG of a rank's schedule,
`rtp_compile.timeline` plots a real profiled 2-rank step, `rtp-compile inspect --draw` draws
from the command line, and the pass log reads as a table."""

import importlib.util
import json
import shutil
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

import rtp_compile
from rtp_compile.apps.cli import main
from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_step
from rtp_compile.inspect.draw import _palette, layered, schedule_graph
from rtp_compile.inspect.traces import STEP
from rtp_compile.passes.manager.pipeline import pass_table

pytest.importorskip("matplotlib")
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def prog():
    torch.manual_seed(0)
    return rtp_compile.transform(TinyGPT(CONFIG), 2)


def test_draw_writes_an_svg_naming_every_unit_and_hop(prog, tmp_path):
    path = prog.draw(0, tmp_path / "rank0.svg")
    assert path == tmp_path / "rank0.svg"
    root = ET.parse(path).getroot()  # well-formed XML
    assert root.tag.endswith("svg")
    text = " ".join(t for t in root.itertext())
    for unit in prog.plan.units:
        if unit.kind not in ("small", "gather"):  # gathered: one box for all small params
            assert unit.name in text, unit.name
    hops = [
        n.args[4]
        for n in prog.module(0).graph.nodes
        if n.target is torch.ops.rtp.ring_shift_start.default
    ]
    assert hops and all(f"send {h}" in text and f"wait {h}" in text for h in hops)
    assert "gathered: small params" in text


def test_draw_writes_a_png_and_refuses_other_formats(prog, tmp_path):
    path = prog.draw(1, tmp_path / "rank1.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"\.svg, \.png, \.pdf"):
        prog.draw(0, tmp_path / "rank0.jpg")


def test_each_unit_or_bucket_has_its_colour_and_each_hop_its_edge(prog):
    graph = schedule_graph(prog.module(0), 2, 0, prog.ctx.buckets)
    boxes = {k: d["box"] for k, d in graph.nodes(data=True)}
    bucket_of = {u: b for b, units in prog.ctx.buckets.items() for u in units}
    steps = [b for b in boxes.values() if b.kind == "step"]
    assert len(steps) == 2 * sum(u.kind in ("rotate", "fused") for u in prog.plan.units)
    for box in steps:
        unit = box.label.split("\n")[0]
        assert box.colour == bucket_of.get(unit, unit)
    colours = _palette(graph)
    assert set(colours) == {b.colour for b in boxes.values() if b.colour}
    assert len(set(colours.values())) == len(colours)  # tab10: distinct up to ten
    hops = [(a, b) for a, b, kind in graph.edges(data="kind") if kind == "hop"]
    sends = [k for k, b in boxes.items() if b.kind == "send"]
    assert len(hops) == len(sends) == 6
    assert all(boxes[a].kind == "send" and boxes[b].kind == "wait" for a, b in hops)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """One real profiled AdamW step of a 2-rank job (gloo), its chrome traces."""
    out = tmp_path_factory.mktemp("traces")
    prog = rtp_compile.transform(TinyGPT(CONFIG), 2)
    return rtp_compile.record_traces(
        lm_step, 2, out, args=(prog, CONFIG.vocab_size, 4, 16), timeout=120
    )


def test_timeline_of_a_real_two_rank_step_shows_compute_against_the_ring(traces, tmp_path):
    assert [p.name for p in traces] == ["rank0.json", "rank1.json"]
    tl = rtp_compile.timeline(traces, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert [r.rank for r in tl.ranks] == [0, 1]
    for r in tl.ranks:
        assert r.compute and r.send and r.wait and r.flight
        assert 0 < r.compute_s < r.step_s and 0 < r.wait_s < r.step_s
        assert 0 <= r.overlap <= 1 and 0 < r.exposed < 1
        assert set(r.phases) == {"backward", "optimizer"}
        assert r.window[0] <= r.phases["backward"] < r.phases["optimizer"] <= r.window[1]
    assert tl.overlap == [r.overlap for r in tl.ranks]
    assert "overlap" in str(tl) and len(str(tl).splitlines()) == 5
    (ax,) = tl.figure.axes
    # per rank its flight, compute, send and wait bars (the phases are lines)
    bars = [c for c in ax.collections if type(c).__name__ != "LineCollection"]
    assert len(bars) == 4 * 2 and all(len(b.get_paths()) for b in bars)
    assert [t.get_text().split("\n")[0] for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]


def test_the_ranks_traces_merge_into_one_for_perfetto(traces):
    merged = json.loads((traces[0].parent / "ranks.json").read_text())["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    names = [e for e in merged if e.get("name") == STEP]
    assert len(names) == 2


def test_timeline_reads_a_profile_object():
    from torch.profiler import profile, record_function

    with profile() as prof, record_function(STEP):
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))
    (r,) = rtp_compile.timeline(prof).ranks
    assert r.compute and not r.flight and r.overlap != r.overlap  # no hop: nan


def test_timeline_names_what_it_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="chrome trace"):
        rtp_compile.timeline(tmp_path / "missing.json")


def test_pass_log_as_a_table(prog):
    table = pass_table(prog.pass_log).splitlines()
    assert table[0].split() == ["pass", "nodes", "added", "removed", "ops", "changed"]
    assert [line.split()[0] for line in table[2:]] == [r.name for r in prog.pass_log]
    schedule = next(line for line in table if line.startswith("schedule"))
    assert "->" in schedule and "more" in schedule


@pytest.mark.slow
def test_inspect_draws_with_draw(tmp_path, capsys):
    out = tmp_path / "tiny.svg"
    assert (
        main(
            ["inspect", "rtp_compile.apps.models:TinyGPT", "--world-size", "2", "--draw", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "rtp cost per rank, N=2" in printed and f"drawn: {out}" in printed
    assert "blocks_0_mlp" in out.read_text()


def test_inspect_refuses_a_drawing_format_before_compiling(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "inspect",
                "rtp_compile.apps.models:TinyGPT",
                "--world-size",
                "2",
                "--draw",
                str(tmp_path / "x.gif"),
            ]
        )
    assert exit_.value.code == 2 and ".svg, .png, .pdf" in capsys.readouterr().err


def test_each_hop_runs_down_its_own_lane_beside_the_compute(prog):
    graph = schedule_graph(prog.module(1), 2, 1, prog.ctx.buckets)
    pos = layered(graph)
    boxes = {k: d["box"] for k, d in graph.nodes(data=True)}
    lanes_from = max(x for k, (x, _) in pos.items() if boxes[k].kind not in ("send", "wait"))
    for send, wait, kind in graph.edges(data="kind"):
        if kind == "hop":
            assert pos[send][0] == pos[wait][0] > lanes_from  # one lane, right of the compute
            assert pos[send][1] > pos[wait][1]  # the send above its wait
    ys = sorted(y for _, y in pos.values())
    assert all(b - a > 0.3 for a, b in zip(ys, ys[1:]) if a != b)  # rows never overlap


@pytest.mark.skipif(
    not (shutil.which("dot") and importlib.util.find_spec("pydot")),
    reason="graphviz (the dot binary and pydot) is not installed",
)
def test_draw_lays_out_with_graphviz_when_installed(prog, tmp_path):
    assert ET.parse(prog.draw(0, tmp_path / "dot.svg")).getroot().tag.endswith("svg")


def test_drawing_without_matplotlib_says_how_to_get_it(prog, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install matplotlib"):
        prog.draw(0, tmp_path / "rank0.svg")
