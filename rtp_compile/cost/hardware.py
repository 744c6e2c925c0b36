"""What a cluster can do, for the time model (`cost.time`): a rank's compute (matmul FLOP/s
per element size, memory bandwidth, the cost of launching one op) and its links, one level per
part of the network (NVLink inside a node, InfiniBand across; gloo on one machine), each with a
latency and a bandwidth per rank and direction (α and 1/β). A description comes from published
specs (the shipped ones: `names()`) or from `rtp-compile calibrate` on the machine itself,
which adds what it measured at each world size (`measured`): the collectives' and the ring
hop's own α–β fits, and the compute as N ranks sharing the machine see it. `overlap`: whether
communication runs beside compute (a GPU's copy engines and NICs) or takes the rank's own
core (gloo between processes of one machine: the kernel copies each message on the
sender's core), `host_runs_ahead`: whether the host issues work before the device needs it.

    hw = rtp_compile.cost.hardware.load("h100-nvlink")       # or a path to a JSON description
    rates = hw.rates(64)                                     # what a rank sees at N = 64
    rates.hop(2**20), rates.all_reduce(2**30)                # seconds

A description is JSON (the calibrated one's keys; specs leave out `measured`):
{"name", "source", "cores", "host_runs_ahead", "overlap", "compute": {"matmul_flops":
{"float32": .., "bfloat16": ..}, "memory_bandwidth", "op_overhead_s", "backward_factor"
(optional: a block's backward time over its forward's, 2 where not measured), "compute_factor"
(optional: a block's measured forward, less its ops' launches, over their roofline time, 1 where
not measured)},
"levels": [{"name", "ranks", "latency_s", "bandwidth"}], "runtime": {"rtp_step_overhead_s",
"fsdp_block_overhead_s", "fsdp_optimizer_overhead_s"}, "measured": {"N": {...}}, "notes": [...]}.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field

_SHIPPED = pathlib.Path(__file__).with_name("descriptions")
_DTYPE_OF_ITEMSIZE = {8: "float64", 4: "float32", 2: "bfloat16", 1: "float8"}
DEFAULT_BACKWARD_FACTOR = 2.0  # a matmul's backward: two matmuls of its size
DEFAULT_COMPUTE_FACTOR = 1.0  # ops run at the roofline the rates give


@dataclass(frozen=True)
class Level:
    """One level of the network: `ranks` share it (ranks per node; None: any number), each
    sending at `bandwidth` bytes/s per direction after `latency_s`."""

    name: str
    ranks: int | None
    latency_s: float
    bandwidth: float


@dataclass(frozen=True)
class Fit:
    """Seconds of one operation on `bytes`: latency + bytes x seconds per byte."""

    latency_s: float
    per_byte_s: float

    def __call__(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.per_byte_s


@dataclass(frozen=True)
class Rates:
    """What one rank sees at one world size: compute rates and each communication's time (the
    collectives' bytes are the full tensor's: all-reduce's input, all-gather's output,
    reduce-scatter's input; a hop's the message's)."""

    world_size: int
    matmul_flops: dict[str, float]
    memory_bandwidth: float
    op_overhead_s: float
    backward_factor: float  # an op's backward time over its forward's
    compute_factor: float  # an op's time after its launch over its roofline's
    rtp_step_overhead_s: float
    fsdp_block_overhead_s: float  # FSDP2's own cost per block and step (hooks, copies)
    fsdp_optimizer_overhead_s: float  # per parameter tensor: the optimizer's ops on DTensors
    host_runs_ahead: bool
    overlap: bool  # communication runs beside compute (else it takes the rank's core)
    hop: Fit
    all_reduce: Fit
    all_gather: Fit
    reduce_scatter: Fit
    measured: bool  # communication from calibration at this N (else from the levels)

    def flops(self, itemsize: int) -> float:
        """Matmul FLOP/s in the dtype of that element size (float32's if not described)."""
        return self.matmul_flops.get(
            _DTYPE_OF_ITEMSIZE.get(itemsize, "float32"), self.matmul_flops["float32"]
        )

    def op_time(self, flops: float, nbytes: float, itemsize: int = 4) -> float:
        """One op: its launch, then the longer of its arithmetic and its memory traffic
        times `compute_factor` (what a real block's ops take over that roofline)."""
        return self.op_overhead_s + self.compute_factor * self.roofline(flops, nbytes, itemsize)

    def roofline(self, flops: float, nbytes: float, itemsize: int = 4) -> float:
        """The longer of an op's arithmetic and its memory traffic at these rates."""
        return max(flops / self.flops(itemsize), nbytes / self.memory_bandwidth)


@dataclass(frozen=True)
class Hardware:
    """A cluster's description (the module docstring)."""

    name: str
    source: str
    compute: dict
    levels: tuple[Level, ...]
    runtime: dict
    cores: int | None = None
    host_runs_ahead: bool = True
    overlap: bool = True
    measured: dict[int, dict] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def level_for(self, world_size: int) -> Level:
        """The slowest level a ring of `world_size` consecutive ranks crosses."""
        for level in self.levels:
            if level.ranks is None or world_size <= level.ranks:
                return level
        return self.levels[-1]

    def rates(self, world_size: int) -> Rates:
        """Rates at `world_size`. Communication: calibrated where this N was measured, else
        the ring algorithms over the slowest level crossed. Compute: the nearest N measured
        with a core per rank (else the description's), and where N ranks share fewer
        `cores`, each rank's compute rates times cores / N (a timed op gets a whole core, so
        calibration at such N cannot see the sharing; the step's total work can)."""
        n = world_size
        measured = self.measured.get(n)
        alone = {m: v for m, v in self.measured.items() if self.cores is None or m <= self.cores}
        nearest = alone[min(alone, key=lambda m: (abs(m - n), -m))] if alone else {}
        compute = {**self.compute, **{k: v for k, v in nearest.items() if k in self.compute}}
        runtime = {**self.runtime, **{k: v for k, v in nearest.items() if k in self.runtime}}
        share = 1.0 if self.cores is None else min(1.0, self.cores / n)  # ranks > cores
        level = self.level_for(n)
        hop = Fit(level.latency_s, 1 / level.bandwidth)
        steps = max(n - 1, 0)
        derived = {
            "ring_hop": hop,
            "all_reduce": Fit(2 * steps * hop.latency_s, 2 * steps / n * hop.per_byte_s),
            "all_gather": Fit(steps * hop.latency_s, steps / n * hop.per_byte_s),
            "reduce_scatter": Fit(steps * hop.latency_s, steps / n * hop.per_byte_s),
        }
        comm = {
            key: Fit(*measured[key]) if measured and key in measured else fit
            for key, fit in derived.items()
        }
        if n == 1:  # one rank: nothing to send
            comm = {key: Fit(0.0, 0.0) for key in comm}
        return Rates(
            world_size=n,
            matmul_flops={d: v * share for d, v in compute["matmul_flops"].items()},
            memory_bandwidth=float(compute["memory_bandwidth"]) * share,
            op_overhead_s=float(compute["op_overhead_s"]) / share,
            backward_factor=float(compute.get("backward_factor", DEFAULT_BACKWARD_FACTOR)),
            compute_factor=float(compute.get("compute_factor", DEFAULT_COMPUTE_FACTOR)),
            rtp_step_overhead_s=float(runtime.get("rtp_step_overhead_s", 0.0)) / share,
            fsdp_block_overhead_s=float(runtime.get("fsdp_block_overhead_s", 0.0)) / share,
            fsdp_optimizer_overhead_s=float(runtime.get("fsdp_optimizer_overhead_s", 0.0)) / share,
            host_runs_ahead=self.host_runs_ahead,
            overlap=self.overlap,
            hop=comm["ring_hop"],
            all_reduce=comm["all_reduce"],
            all_gather=comm["all_gather"],
            reduce_scatter=comm["reduce_scatter"],
            measured=bool(measured),
        )

    def across_nodes(self, replicas: int, ring: int) -> Fit:
        """An all-reduce among `replicas` ranks, one in each ring of `ring` ranks (a 2-D mesh:
        the rings inside nodes, the replicas across), over the level the rings don't reach."""
        outer = self.level_for(replicas * ring)
        steps = max(replicas - 1, 0)
        return Fit(2 * steps * outer.latency_s, 2 * steps / replicas / outer.bandwidth)

    def assumptions(self, world_size: int) -> str:
        """One line of what the prediction at `world_size` assumes."""
        r = self.rates(world_size)
        level = self.level_for(world_size)
        flops = ", ".join(f"{d} {v / 1e12:.3g} TFLOP/s" for d, v in r.matmul_flops.items())
        link = (
            f"measured at N={world_size}: hop {r.hop.latency_s * 1e6:.0f} us + "
            f"{1 / r.hop.per_byte_s / 1e9:.3g} GB/s"
            if r.measured
            else f"{level.name}: {level.latency_s * 1e6:.3g} us, {level.bandwidth / 1e9:.3g} GB/s"
        )
        return (
            f"{self.name}: matmul {flops}; memory {r.memory_bandwidth / 1e9:.3g} GB/s; "
            f"{r.op_overhead_s * 1e6:.3g} us per op; backward {r.backward_factor:.3g} x "
            f"forward; ops {r.compute_factor:.3g} x their roofline; RTP runtime "
            f"{r.rtp_step_overhead_s * 1e6:.3g} us per unit-step; {link}"
        )

    @classmethod
    def from_dict(cls, d: dict) -> Hardware:
        try:
            return cls(
                name=d["name"],
                source=d.get("source", ""),
                compute=d["compute"],
                levels=tuple(Level(**level) for level in d["levels"]),
                runtime=d.get("runtime", {}),
                cores=d.get("cores"),
                host_runs_ahead=d.get("host_runs_ahead", True),
                overlap=d.get("overlap", True),
                measured={int(n): v for n, v in d.get("measured", {}).items() if v},
                notes=tuple(d.get("notes", ())),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"rtp_compile.cost.hardware: a description needs name, compute (matmul_flops, "
                f"memory_bandwidth, op_overhead_s) and levels (name, ranks, latency_s, "
                f"bandwidth); {e!r} in {d.get('name', d)!r}"
            ) from e


def names() -> list[str]:
    """The shipped descriptions."""
    return sorted(p.stem for p in _SHIPPED.glob("*.json"))


def load(spec) -> Hardware:
    """A description: a `Hardware`, a shipped name (`names()`), or a path to a JSON file."""
    if isinstance(spec, Hardware):
        return spec
    path = pathlib.Path(str(spec))
    if not path.suffix and (_SHIPPED / f"{spec}.json").exists():
        path = _SHIPPED / f"{spec}.json"
    if not path.exists():
        raise ValueError(
            f"rtp_compile.cost.hardware: no description {spec!r}: pass one of {names()} or a "
            "path to a JSON file (`rtp-compile calibrate` writes one for this machine)"
        )
    hardware = Hardware.from_dict(json.loads(path.read_text()))
    if not all(math.isfinite(v) and v > 0 for v in hardware.compute["matmul_flops"].values()):
        raise ValueError(f"rtp_compile.cost.hardware: {path}: matmul_flops must be positive")
    return hardware
