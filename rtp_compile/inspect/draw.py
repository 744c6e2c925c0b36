"""A rank's program drawn as its schedule: `RTPProgram.draw(rank, path)`.

The rank's fx graph is collapsed into boxes a person can read at a glance: each forward step of
a rotation unit (its compute with the shard the rank holds then, `core.ir.NodeLabel`), each ring
hop's start ("send") and wait, each gathered op, and each run of plain ops between them. A
unit's parameter reads, detaches and views are drawn through, not as boxes. Edges: data flow,
each hop from its send to its wait (the message in flight, with its bytes), and the schedule's
order (a hop flies over the compute between its send and its wait). One colour per unit, or per
bucket for the units that share its messages; gathered ops in dashed boxes.

Layout: graphviz's `dot` when pydot and the `dot` binary are installed, else networkx's layers
(topological generations, top to bottom, the program's order); matplotlib draws, imported only
here.
"""

from __future__ import annotations

import operator
import pathlib
import shutil
from dataclasses import dataclass

import networkx as nx
import torch.fx as fx

from rtp_compile.core.ir import Action, UnitKind, label_of, target_name
from rtp_compile.runtime.events import forward_shard

FORMATS = (".svg", ".png", ".pdf")
_THROUGH = {operator.getitem, "detach", "rtp_job"}  # plumbing: drawn through, not as a box
_COLUMN, _ROW = 2.3, 0.4  # inches between box centres side by side; margin above and below
_VIEWS = {
    "chunk",
    "unflatten",
    "flatten",
    "transpose",
    "view",
    "reshape",
    "permute",
    "contiguous",
    "size",
    "getattr",
    "narrow",
}


@dataclass(frozen=True)
class Box:
    """One drawn box: `kind` is "input", "output", "ops", "step", "send", "wait" or
    "gathered"; `colour` the unit or bucket whose colour it takes (None: plain ops); `order`
    where its first node lies in the program."""

    kind: str
    label: str
    colour: str | None
    order: int


def schedule_graph(
    gm: fx.GraphModule, world_size: int, rank: int, buckets: dict[str, tuple[str, ...]]
) -> nx.DiGraph:
    """The boxes of rank `rank`'s module `gm` (`Box` in each node's "box") and the edges
    between them ("kind": "data", "hop" or "order"); `buckets` (ctx.buckets) gives the units
    that share a colour."""
    colour_of = {unit: name for name, units in buckets.items() for unit in units}
    box_of: dict[fx.Node, str | None] = {}
    members: dict[str, list[fx.Node]] = {}
    run = 0
    for node in gm.graph.nodes:
        key = _box_key(node, world_size)
        if key == "ops":
            key = f"ops {run}"
        elif key is not None:
            run += 1  # a box between two plain ops ends their run
        box_of[node] = key
        if key is not None:
            members.setdefault(key, []).append(node)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    graph = nx.DiGraph()
    for key, nodes in members.items():
        graph.add_node(key, box=_box(key, nodes, order[nodes[0]], world_size, rank, colour_of))
    for node, key in box_of.items():
        if key is None:
            continue
        for source in _sources(node, box_of):
            if source != key:
                hop = graph.nodes[source]["box"].kind == "send" and key == _wait_of(source)
                graph.add_edge(source, key, kind="hop" if hop else "data")
    _add_order_edges(graph)
    return graph


def _box_key(node: fx.Node, n: int) -> str | None:
    """The box `node` belongs to; "ops" for a plain op; None for plumbing drawn through."""
    label = label_of(node)
    if node.op == "placeholder":
        return f"input {node.name}"
    if node.op == "output":
        return "output"
    if label is None:
        return None if node.op == "get_attr" or node.target in _THROUGH else "ops"
    action, unit, step = label.action, label.unit, label.step
    if action in (Action.DETACH, Action.BUCKET):
        return None
    if action in (Action.START, Action.WAIT):
        return f"{'send' if action == Action.START else 'wait'} {unit} {step}"
    if action in (UnitKind.GATHER, UnitKind.SMALL):
        return f"gathered {unit}"
    return f"step {unit} {n - 1 if step is None else step}"  # the autograd link: last step


def _wait_of(send_key: str) -> str:
    return "wait" + send_key[len("send") :]


def _box(key: str, nodes: list[fx.Node], order: int, n: int, rank: int, colour_of) -> Box:
    """The box of `nodes` (in program order), labelled by what they do."""
    kind, first = key.split(" ", 1)[0], nodes[0]
    label = label_of(first)
    unit = None if label is None else label.unit
    small = label is not None and label.action == UnitKind.SMALL
    colour = "small parameters" if small else colour_of.get(unit, unit)
    if kind == "step":
        step = int(key.rsplit(" ", 1)[1])
        text = f"{unit}\nstep {step}: shard {forward_shard(rank, step, n)}"
    elif kind == "send":  # its node: ring_shift_start(tensors, group, shift, tag, where)
        text = f"send {first.args[4]}\n{_kib(label.bytes)}"
    elif kind == "wait":  # its first node: ring_wait(what the send receives into)
        text = f"wait {first.args[0].args[4]}"
    elif kind == "gathered":
        units = label.units or [unit]
        text = (
            f"gathered: {unit}"
            if len(units) == 1
            else f"gathered: small params\n({len(units)} units)"
        )
    elif kind == "ops":
        text, colour = _ops_label(nodes), None
    else:
        text, colour = key.split(" ", 1)[-1], None
    return Box(kind, text, colour, order)


def _ops_label(nodes: list[fx.Node]) -> str:
    """What a run of plain ops computes: its ops (each once, views and reshapes left out
    where others remain), at most three lines."""
    names = list(dict.fromkeys(target_name(node) for node in nodes))
    names = [name for name in names if name not in _VIEWS] or names
    return "\n".join(names[:3] + ([f"+{len(names) - 3} more"] if len(names) > 3 else []))


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def _sources(node: fx.Node, box_of) -> set[str]:
    """The boxes whose values `node` reads, looking through plumbing."""
    found, todo, seen = set(), list(node.all_input_nodes), set()
    while todo:
        source = todo.pop()
        if source in seen:
            continue
        seen.add(source)
        if box_of.get(source) is None:
            todo += source.all_input_nodes
        else:
            found.add(box_of[source])
    return found


def _add_order_edges(graph: nx.DiGraph) -> None:
    """Order edges: each send after the box before it in the program and before the compute
    that follows it, each wait after the compute before it (so the drawing shows what a hop
    flies over); any other box that reads nothing drawn (a gather of its own shards) after
    the box before it."""
    boxes = sorted(graph.nodes, key=lambda k: graph.nodes[k]["box"].order)
    computes = [k for k in boxes if graph.nodes[k]["box"].kind in ("step", "ops", "gathered")]
    for before, key in zip(boxes, boxes[1:]):
        box = graph.nodes[key]["box"]
        if box.kind == "send" or graph.in_degree(key) == 0:
            graph.add_edge(before, key, kind="order")
        if box.kind == "send":
            after = [c for c in computes if graph.nodes[c]["box"].order > box.order]
            if after and not graph.has_edge(key, after[0]):
                graph.add_edge(key, after[0], kind="order")
        elif box.kind == "wait":
            done = [c for c in computes if graph.nodes[c]["box"].order < box.order]
            if done and not graph.has_edge(done[-1], key):
                graph.add_edge(done[-1], key, kind="order")


def draw(prog, rank: int, path) -> pathlib.Path:
    """Draw rank `rank`'s module of `prog` (`schedule_graph`) to `path`: SVG, PNG or PDF by
    its suffix (an SVG keeps its text as text). Returns the path."""
    path = pathlib.Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(
            f"rtp_compile: draw writes {', '.join(FORMATS)} (by the path's suffix), "
            f"got {str(path)!r}"
        )
    graph = schedule_graph(prog.module(rank), prog.world_size, rank, prog.ctx.buckets)
    figure = render(graph, f"rank {rank} of {prog.world_size}: the forward schedule")
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figure.savefig(path, bbox_inches="tight", dpi=110)
    return path


def render(graph: nx.DiGraph, title: str):
    """A matplotlib Figure of a `schedule_graph`: boxes at their `layout` places (inches),
    arrows between them, a legend of the colours."""
    figure_class = matplotlib_figure()
    pos = layout(graph)
    xs, ys = [x for x, _ in pos.values()], [y for _, y in pos.values()]
    width, height = max(xs) - min(xs) + 2 * _COLUMN, max(ys) - min(ys) + 2 * _ROW
    fig = figure_class(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.set_xlim(min(xs) - _COLUMN, max(xs) + _COLUMN)
    ax.set_ylim(min(ys) - _ROW, max(ys) + _ROW)
    ax.text(min(xs) - _COLUMN, max(ys) + _ROW, title, fontsize=10, va="top")
    colours = _palette(graph)
    texts = {
        key: ax.text(
            *pos[key],
            data["box"].label,
            ha="center",
            va="center",
            fontsize=7,
            zorder=3,
            bbox=_box_style(data["box"], colours),
        )
        for key, data in graph.nodes(data=True)
    }
    for a, b, kind in graph.edges(data="kind"):
        _arrow(ax, texts[a], texts[b], kind, colours.get(graph.nodes[a]["box"].colour, "grey"))
    ax.legend(
        handles=_legend(graph, colours),
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        frameon=False,
    )
    return fig


def matplotlib_figure():
    """matplotlib's Figure class (no pyplot: nothing global changes), or an ImportError that
    says how to get it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("rtp_compile: drawing needs matplotlib: pip install matplotlib") from err
    return Figure


def layout(graph: nx.DiGraph) -> dict[str, tuple[float, float]]:
    """Where each box goes, in inches: graphviz's dot when installed, else `layered`."""
    if shutil.which("dot") and _has("pydot"):
        numbered = nx.convert_node_labels_to_integers(graph, label_attribute="key")
        placed = nx.nx_pydot.graphviz_layout(numbered, prog="dot")  # points
        return {numbered.nodes[i]["key"]: (x / 72, y / 72) for i, (x, y) in placed.items()}
    return layered(graph)


def layered(graph: nx.DiGraph) -> dict[str, tuple[float, float]]:
    """networkx's layers, in inches: each box one topological generation below what it
    depends on, boxes of one generation side by side in program order, each row as tall as
    its tallest box; the hops in lanes right of the compute (`_hop_lanes`)."""
    rows = [
        sorted(keys, key=lambda k: graph.nodes[k]["box"].order)
        for keys in nx.topological_generations(graph)
    ]
    lanes = _hop_lanes(graph, {k: i for i, keys in enumerate(rows) for k in keys})
    middles = [[k for k in keys if k not in lanes] for keys in rows]
    right = max((len(m) - 1) / 2 for m in middles) + 1  # the first lane, in columns
    pos, y = {}, 0.0
    for keys, middle in zip(rows, middles):
        lines = max(graph.nodes[k]["box"].label.count("\n") + 1 for k in keys)
        y -= 0.13 * lines + 0.25
        for i, key in enumerate(middle):
            pos[key] = ((i - (len(middle) - 1) / 2) * _COLUMN, y)
        for key in set(keys) & set(lanes):
            pos[key] = ((right + lanes[key]) * _COLUMN, y)
    return pos


def _hop_lanes(graph: nx.DiGraph, row: dict[str, int]) -> dict[str, int]:
    """Each hop's send and wait in a lane right of the compute, one lane per hop in flight at
    once (a lane is free again below its last wait): a hop's arrow then runs straight down
    beside the compute it flies over."""
    busy: list[int] = []  # per lane, the row of its last wait
    lanes = {}
    hops = sorted(
        ((a, b) for a, b, kind in graph.edges(data="kind") if kind == "hop"),
        key=lambda hop: row[hop[0]],
    )
    for send, wait in hops:
        lane = next((i for i, last in enumerate(busy) if last < row[send]), len(busy))
        if lane == len(busy):
            busy.append(row[wait])
        busy[lane] = row[wait]
        lanes[send] = lanes[wait] = lane
    return lanes


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _palette(graph: nx.DiGraph) -> dict[str, tuple]:
    """One colour per unit or bucket (tab10, repeating after ten), in the order they first
    appear in the program."""
    from matplotlib import colormaps

    first: dict[str, int] = {}
    for _, data in graph.nodes(data=True):
        box = data["box"]
        if box.colour:
            first[box.colour] = min(first.get(box.colour, box.order), box.order)
    names = sorted(first, key=first.get)
    return {name: colormaps["tab10"](i % 10) for i, name in enumerate(names)}


def _light(colour) -> tuple:
    """`colour` mixed half with white: a fill black text reads well on."""
    return tuple(0.5 + 0.5 * c for c in colour[:3])


def _box_style(box: Box, colours) -> dict:
    colour = colours.get(box.colour, (0.6, 0.6, 0.6))
    if box.kind == "step":
        return dict(boxstyle="round,pad=0.35", fc=_light(colour), ec=colour, lw=1.0)
    if box.kind in ("send", "wait"):
        return dict(
            boxstyle="rarrow,pad=0.3" if box.kind == "send" else "larrow,pad=0.3",
            fc="white",
            ec=colour,
            lw=1.5,
        )
    if box.kind == "gathered":
        return dict(boxstyle="square,pad=0.35", fc=_light(colour), ec="black", lw=1.2, ls="--")
    if box.kind == "ops":
        return dict(boxstyle="round,pad=0.3", fc="#f2f2f2", ec="#999999", lw=0.5)
    return dict(boxstyle="round,pad=0.35", fc="white", ec="black", lw=1.0)


def _arrow(ax, a, b, kind: str, colour) -> None:
    style = {
        "data": dict(color="#555555", lw=0.7, ls="-"),
        "hop": dict(color=colour, lw=2.0, ls="--"),
        "order": dict(color="#aaaaaa", lw=0.7, ls=":"),
    }[kind]
    ax.annotate(
        "",
        xy=(0.5, 0.5),
        xycoords=b,
        xytext=(0.5, 0.5),
        textcoords=a,
        zorder=2,
        arrowprops=dict(
            arrowstyle="-|>",
            patchA=a.get_bbox_patch(),
            patchB=b.get_bbox_patch(),
            shrinkA=1,
            shrinkB=1,
            connectionstyle="arc3",
            **style,
        ),
    )


def _legend(graph: nx.DiGraph, colours) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(fc=_light(c), ec=c, label=name) for name, c in colours.items()]
    if any(d["box"].kind == "gathered" for _, d in graph.nodes(data=True)):
        handles.append(Patch(fc="white", ec="black", ls="--", label="gathered (no rotation)"))
    return handles + [
        Line2D([], [], color="black", lw=2, ls="--", label="ring hop: send -> wait"),
        Line2D([], [], color="#555555", lw=0.7, label="data"),
        Line2D([], [], color="#aaaaaa", lw=0.7, ls=":", label="order (a hop flies over it)"),
    ]
