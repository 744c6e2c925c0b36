"""Predicted time of one training step per rank, for RTP, DDP and FSDP2 on the same model,
batch and world size, before anything runs (`prog.cost(..., hardware=...).step_time`).

Each op of the forward (`cost.profile`: its FLOPs and bytes, measured on fake tensors) costs
its launch plus the longer of its arithmetic and its memory traffic at the hardware's rates
(`cost.hardware`) times `compute_factor` (1 unless calibrated: a transformer block's measured
forward, less its launches, over that roofline); its backward `backward_factor` times that (2,
a matmul's two, unless calibrated on the same block). A rank has two resources, its compute
stream and its link, and each kind's step is replayed on them in program order:

- DDP: forward, then backward; each 25 MiB gradient bucket (in reverse parameter order, as
  the reducer fills them) is all-reduced on the link once its last gradient is produced, while
  backward goes on; the step ends when both are done, then the optimizer runs on every weight.
- FSDP2: one all-gather per block (`fully_shard` per ModuleList element, then the root) before
  its forward and again before its backward, each gathered block copied out of the flat
  buffer; in backward the next block's all-gather is issued ahead, and each block's gradients
  are reduce-scattered after it. Where the host runs ahead of the device (a GPU), forward
  all-gathers are issued one block ahead too; on a CPU they are waited where issued. Each
  block also pays FSDP2's own per-step cost (hooks, calibrated), and the optimizer, on 1/N of
  the weights, a calibrated cost per DTensor parameter.
- RTP: a rotated unit computes in N steps of 1/N of its work, each step also paying the
  runtime's per-step cost (calibrated); its N - 1 weight hops run on the link while it
  computes (the first one during the previous unit's last step), its backward re-fetches them
  and passes N - 1 gradient accumulators, each after the step that adds to it. A bucket
  fetches its units' shards in one message per hop and reduce-scatters their gradient rows
  at its first unit, waiting for each hop. The small parameters are all-gathered once at the
  start and reduce-scattered once at the end. The optimizer runs on 1/N of the weights.

The loss adds one pass over the output forward and one backward (cross-entropy); AdamW costs
8 ops per tensor and 19 bytes read or written per element of its state (the single-tensor
loop a CPU runs).

What it does not see: kernels slower than the roofline on small shapes, the rank's other
threads (gloo's) taking compute from it, contention between a link's two directions, the
allocator, stragglers, and jitter between ranks (each hop waits for the slower of two).
"""

from __future__ import annotations

from dataclasses import dataclass

from rtp_compile.core.ir import UnitKind
from rtp_compile.cost.hardware import Fit, Rates
from rtp_compile.cost.profile import OpWork, Profile

DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
OPTIMIZER_OPS_PER_TENSOR = 8
OPTIMIZER_BYTES_PER_ELEMENT = 19
FORWARD_SHARE_OF_STEP_OVERHEAD = 1 / 3  # the runtime's per-step cost: forward's share


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds on one rank: `step_s` in all; `compute_s` what the compute
    stream is busy (forward, backward, optimizer, per-step overheads); `exposed_s` the time it
    waits for the link; `comm_s` how long the link is busy."""

    kind: str
    world_size: int
    hardware: str
    step_s: float
    compute_s: float
    exposed_s: float
    comm_s: float
    optimizer_s: float

    def __str__(self) -> str:
        return (
            f"{self.kind} step at N={self.world_size} on {self.hardware}: "
            f"{self.step_s * 1e3:.2f} ms (compute {self.compute_s * 1e3:.2f}, exposed "
            f"communication {self.exposed_s * 1e3:.2f}, link busy {self.comm_s * 1e3:.2f}, "
            f"optimizer {self.optimizer_s * 1e3:.2f})"
        )


class _Rank:
    """A rank's compute stream (`t`: when it is next free) and its link (`link`, `busy`);
    without `overlap`, a transfer takes the compute stream too, from its start to its end."""

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap
        self.t = 0.0
        self.link = 0.0
        self.busy = 0.0
        self.computing = 0.0
        self.outer = 0.0  # a second link (a 2-D mesh's replicas, across nodes)

    def compute(self, seconds: float) -> float:
        self.t += seconds
        self.computing += seconds
        return self.t

    def wait(self, until: float) -> None:
        self.t = max(self.t, until)

    def send(self, seconds: float, ready: float) -> float:
        """A transfer that may start at `ready`, after the link's earlier ones: its end."""
        start = max(ready, self.link)
        if not self.overlap:  # the rank's own core moves it, once it has issued it
            start = max(start, self.t)
            self.t = start + seconds
        self.link = start + seconds
        self.busy += seconds
        return self.link

    def send_outer(self, seconds: float, ready: float) -> float:
        """The same on the second link."""
        self.outer = max(ready, self.outer, self.t if not self.overlap else 0.0) + seconds
        if not self.overlap:
            self.t = self.outer
        self.busy += seconds
        return self.outer


# -- the forward's ops, grouped by what owns the weights they read -----------------------
def _segments(ops: list[OpWork], owner) -> list[tuple[object, list[OpWork]]]:
    """Consecutive ops as (owner, ops): `owner(op)` names the unit or block whose weights an op
    reads (None: none); ops between two of one owner's belong to it (a block's inner ops)."""
    segments: list[tuple[object, list[OpWork]]] = []
    for op in ops:
        key = owner(op)
        if segments and segments[-1][0] == key:
            segments[-1][1].append(op)
        else:
            segments.append((key, [op]))
    merged: list[tuple[object, list[OpWork]]] = []
    for key, seg in segments:
        if key is not None and len(merged) >= 2 and merged[-1][0] is None and merged[-2][0] == key:
            free = merged.pop()[1]
            merged[-1] = (key, merged[-1][1] + free + seg)
        elif merged and merged[-1][0] == key:
            merged[-1] = (key, merged[-1][1] + seg)
        else:
            merged.append((key, seg))
    return merged


def _ops_time(ops: list[OpWork], rates: Rates, pieces: int = 1) -> float:
    """One of `pieces` equal steps of `ops` (each step launches every op on 1/pieces)."""
    return sum(rates.op_time(o.flops / pieces, o.bytes / pieces, o.itemsize) for o in ops)


def _loss_time(profile: Profile, rates: Rates) -> float:
    return 2 * rates.op_overhead_s + 3 * profile.output_bytes / rates.memory_bandwidth


def _optimizer_time(tensors: int, elements: float, itemsize: int, rates: Rates) -> float:
    return (
        tensors * OPTIMIZER_OPS_PER_TENSOR * rates.op_overhead_s
        + elements * itemsize * OPTIMIZER_BYTES_PER_ELEMENT / rates.memory_bandwidth
    )


def _result(kind, rates, hardware, rank: _Rank, optimizer_s) -> StepTime:
    step = rank.t
    return StepTime(
        kind,
        rates.world_size,
        hardware,
        step,
        rank.computing,
        max(step - rank.computing, 0.0),
        rank.busy,
        optimizer_s,
    )


# -- DDP -------------------------------------------------------------------------------------
def ddp_time(params: dict, profile: Profile, rates: Rates, hardware: str = "") -> StepTime:
    """DDP's step (the module docstring): `params` name -> tensor, in registration order."""
    rank = _Rank(rates.overlap)
    rank.compute(_ops_time(profile.ops, rates) + _loss_time(profile, rates))
    ready: dict[str, float] = {}
    order = list(reversed(profile.ops))
    rank.compute(rates.backward_factor * _loss_time(profile, rates))
    for op in order:
        rank.compute(rates.backward_factor * _ops_time([op], rates))
        for name in op.reads:
            ready.setdefault(name, rank.t)  # the first backward use: its gradient complete
    buckets, size, cap = [[]], 0, DDP_FIRST_BUCKET_BYTES
    for name in reversed(list(params)):
        p = params[name]
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if size and size + nbytes > cap:
            buckets.append([])
            size, cap = 0, DDP_BUCKET_BYTES
        buckets[-1].append(name)
        size += nbytes
    end = rank.t
    for names in buckets:
        if not names:
            continue
        nbytes = sum(params[n].numel() * params[n].element_size() for n in names)
        rank.compute(2 * nbytes / rates.memory_bandwidth)  # gradients copied into the bucket
        when = max(ready.get(n, end) for n in names)
        end = rank.send(rates.all_reduce(nbytes), when)
    rank.wait(end)
    trained = [p for p in params.values() if p.requires_grad]
    opt = _optimizer_time(len(trained), sum(p.numel() for p in trained), _itemsize(trained), rates)
    rank.compute(opt)
    return _result("ddp", rates, hardware, rank, opt)


def _itemsize(tensors) -> int:
    return tensors[0].element_size() if tensors else 4


# -- FSDP2 -----------------------------------------------------------------------------------
def fsdp_time(
    params: dict, profile: Profile, blocks: list[list[str]], rates: Rates, hardware: str = ""
) -> StepTime:
    """FSDP2's step (the module docstring); `blocks` as `cost.model.fsdp_blocks` groups them,
    the root last."""
    n = rates.world_size
    block_of = {name: i for i, names in enumerate(blocks) for name in names}
    root = len(blocks) - 1
    full = [sum(params[m].numel() * params[m].element_size() for m in names) for names in blocks]

    def owner(op):
        keys = [block_of[r] for r in op.reads if r in block_of and block_of[r] != root]
        return keys[0] if keys else None

    segments = _segments(profile.ops, owner)
    rank = _Rank(rates.overlap)

    def gather(i: int, ready: float) -> float:
        return rank.send(rates.all_gather(full[i]), ready) if n > 1 else ready

    def copy_out(i: int) -> None:
        if n > 1:
            rank.compute(2 * full[i] / rates.memory_bandwidth)

    rank.wait(gather(root, 0.0))  # the root's parameters, gathered first, kept to backward
    copy_out(root)

    def next_block(order, position):
        return next((k for k, _ in order[position + 1 :] if k is not None), None)

    def unshard(order, position, issued, prefetch: bool, share: float) -> None:
        """Block `order[position]` gathered (issued now unless issued ahead) and copied out,
        the next block's gather issued ahead where `prefetch`, FSDP2's share of its cost."""
        key = order[position][0]
        if key not in issued:
            issued[key] = gather(key, rank.t)
        rank.wait(issued.pop(key))
        copy_out(key)
        later = next_block(order, position)
        if prefetch and later is not None and later not in issued:
            issued[later] = gather(later, rank.t)
        rank.compute(rates.fsdp_block_overhead_s * share)

    issued: dict[int, float] = {}
    for position, (key, ops) in enumerate(segments):
        if key is not None:  # forward: issued ahead only where the host runs ahead
            unshard(
                segments, position, issued, rates.host_runs_ahead, FORWARD_SHARE_OF_STEP_OVERHEAD
            )
        rank.compute(_ops_time(ops, rates))
    rank.compute(_loss_time(profile, rates) * (1 + rates.backward_factor))
    issued = {}
    scattered = 0.0
    backward = list(reversed(segments))
    for position, (key, ops) in enumerate(backward):
        if key is not None:  # backward prefetch: always
            unshard(backward, position, issued, True, 1 - FORWARD_SHARE_OF_STEP_OVERHEAD)
        rank.compute(rates.backward_factor * _ops_time(ops, rates))
        if key is not None and n > 1:
            scattered = rank.send(rates.reduce_scatter(full[key]), rank.t)
    if n > 1:
        scattered = rank.send(rates.reduce_scatter(full[root]), rank.t)
    rank.wait(scattered)
    trained = [p for p in params.values() if p.requires_grad]
    opt = (
        _optimizer_time(
            len(trained), sum(p.numel() for p in trained) / n, _itemsize(trained), rates
        )
        + len(trained) * rates.fsdp_optimizer_overhead_s
    )
    rank.compute(opt)
    return _result("fsdp2", rates, hardware, rank, opt)


# -- RTP -------------------------------------------------------------------------------------
def _replica_all_reduce(plan, produced: dict[str, float], rank: _Rank, across: Fit) -> None:
    """A 2-D mesh's replicas: the shards' gradients all-reduced in DDP-sized buckets in
    reverse parameter order, each started once complete, on the second link; waited."""
    end, size, names = rank.t, 0.0, []
    buckets = []
    for name in reversed(list(plan.params)):
        nbytes = plan.params[name].shard_bytes
        if names and size + nbytes > DDP_BUCKET_BYTES:
            buckets.append((names, size))
            names, size = [], 0.0
        names.append(name)
        size += nbytes
    if names:
        buckets.append((names, size))
    for names, size in buckets:
        end = rank.send_outer(across(size), max(produced.get(m, rank.t) for m in names))
    rank.wait(end)


def rtp_time(
    plan,
    profile: Profile,
    messages: dict[str, tuple[float, float]],
    buckets: dict[str, tuple[str, ...]],
    rates: Rates,
    hardware: str = "",
    replicas: int = 1,
    across: Fit | None = None,
) -> StepTime:
    """RTP's step (the module docstring). `messages`: unit or bucket name -> (weight message,
    gradient message) bytes per hop at this N; `buckets`: bucket -> its units. `replicas` > 1:
    a 2-D mesh, whose replicas all-reduce the shards' gradients on a second link (`across`)
    in 25 MiB buckets in reverse parameter order, each once backward produced it, as
    `runtime.replicas` does."""
    n = rates.world_size
    units = {u.name: u for u in plan.units}
    bucket_of = {m: b for b, members in buckets.items() for m in members}
    unit_of_param: dict[str, list[str]] = {}
    for u in plan.units:
        for p in u.params.values():
            unit_of_param.setdefault(p, []).append(u.name)
    index: dict[str, int] = {}  # parameter -> which of its units reads it now
    previous: list[str | None] = [None]  # the unit of the last op that read weights

    def owner(op):
        """The unit of an op's weights; a weight several units read (tied) is theirs in turn:
        the next one's once another unit's ops came between."""
        for r in op.reads:
            names = unit_of_param.get(r)
            if names:
                i = index.get(r)
                if i is None:
                    i = 0
                elif previous[0] != names[i] and i + 1 < len(names):
                    i += 1
                index[r] = i
                previous[0] = names[i]
                return names[i]
        return None

    segments = _segments(profile.ops, owner)
    sigma_f = rates.rtp_step_overhead_s * FORWARD_SHARE_OF_STEP_OVERHEAD
    sigma_b = rates.rtp_step_overhead_s - sigma_f
    rank = _Rank(rates.overlap)
    small = [u.name for u in plan.units if u.kind == UnitKind.SMALL]
    small_arrived = (
        rank.send(rates.all_gather(messages["small"][0] * n), 0.0) if small and n > 1 else 0.0
    )
    hop = rates.hop
    arrivals: dict[str, list[float]] = {}  # bucket -> when each shard is here
    last_step_start = 0.0
    for key, ops in segments:
        unit = units.get(key) if key is not None else None
        if unit is None:
            rank.compute(_ops_time(ops, rates))
            continue
        if unit.kind == UnitKind.SMALL or n == 1:
            rank.wait(small_arrived)
            rank.compute(_ops_time(ops, rates))
            continue
        if unit.kind == UnitKind.GATHER:
            arrived = rank.t
            for _ in range(n - 1):
                arrived = rank.send(hop(messages[unit.name][0]), arrived)
            rank.wait(arrived)
            rank.compute(_ops_time(ops, rates))
            continue
        bucket = bucket_of.get(unit.name)
        if bucket is not None:
            if bucket not in arrivals:  # its first unit: the whole bucket's hops, chained
                times, when = [rank.t], last_step_start
                for _ in range(n - 1):
                    when = rank.send(hop(messages[bucket][0]), when)
                    times.append(when)
                arrivals[bucket] = times
            times = arrivals[bucket]
        else:
            times, ready = [rank.t], last_step_start
            for _ in range(n - 1):
                times.append(rank.send(hop(messages[unit.name][0]), ready))
                ready = times[-1]
        step = _ops_time(ops, rates, n) + sigma_f
        for s in range(n):
            rank.wait(times[s])
            last_step_start = rank.t
            rank.compute(step)
    rank.compute(_loss_time(profile, rates) * (1 + rates.backward_factor))
    fetched: dict[str, list[float]] = {}
    rows_left = {b: len(members) for b, members in buckets.items()}
    produced: dict[str, float] = {}  # parameter -> when its shard's gradient is complete

    def backward(unit, ops) -> list[str]:
        """Replay one segment's backward; the units whose gradients it completes."""
        if unit is None or unit.kind == UnitKind.SMALL or n == 1:
            rank.compute(rates.backward_factor * _ops_time(ops, rates))
            return [] if unit is None else [unit.name]
        weights, grads = messages.get(bucket_of.get(unit.name, unit.name), (0.0, 0.0))
        step = rates.backward_factor * _ops_time(ops, rates, n) + sigma_b
        if unit.kind == UnitKind.GATHER:
            arrived = rank.t
            for _ in range(n - 1):
                arrived = rank.send(hop(weights), arrived)
            rank.wait(arrived)
            rank.compute(rates.backward_factor * _ops_time(ops, rates))
            for _ in range(n - 1):
                rank.wait(rank.send(hop(grads), rank.t))
            return [unit.name]
        bucket = bucket_of.get(unit.name)
        if bucket is not None:
            if bucket not in fetched:  # the bucket's last unit fetches for all of them
                times, when = [rank.t], rank.t
                for _ in range(n - 1):
                    when = rank.send(hop(weights), when)
                    times.append(when)
                fetched[bucket] = times
            for s in range(n):
                rank.wait(fetched[bucket][s])
                rank.compute(step)
            rows_left[bucket] -= 1
            if rows_left[bucket]:
                return []
            for _ in range(n - 1):  # its first unit: the rows reduce-scattered, each waited
                rank.wait(rank.send(hop(grads), rank.t))
                rank.compute(rates.op_time(0.0, 3 * grads))
            return list(buckets[bucket])
        accumulated = 0.0
        for s in range(n):
            weight = rank.send(hop(weights), rank.t) if s < n - 1 else rank.t
            rank.compute(step)
            rank.wait(accumulated)
            if s < n - 1:
                accumulated = rank.send(hop(grads), rank.t)
                rank.wait(weight)
        rank.wait(accumulated)
        return [unit.name]

    for key, ops in reversed(segments):
        for done in backward(units.get(key) if key is not None else None, ops):
            for p in units[done].params.values():
                produced.setdefault(p, rank.t)
    if small and n > 1:
        rank.wait(rank.send(rates.reduce_scatter(messages["small"][1] * n), rank.t))
    if replicas > 1 and across is not None:
        _replica_all_reduce(plan, produced, rank, across)
    shard_elements = sum(
        lay.shard_bytes / max(lay.dtype.itemsize, 1) for lay in plan.params.values()
    )
    itemsize = next(iter(plan.params.values())).dtype.itemsize if plan.params else 4
    opt = _optimizer_time(len(plan.params), shard_elements, itemsize, rates)
    rank.compute(opt)
    return _result("rtp", rates, hardware, rank, opt)
