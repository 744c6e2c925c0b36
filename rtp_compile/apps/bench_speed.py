"""Step time of one GPT-style model trained four ways on the same ranks, side by side: DDP,
FSDP2 (`fully_shard` per block, then the root), DTensor tensor parallel (`parallelize_module`,
Megatron-style: qkv and the MLP's first linear column-wise, the projections row-wise, heads
split across ranks) and RTP.

One job per world size (local processes: gloo on CPU, NCCL where every rank has a GPU). Every
kind gets a warm-up step, then `rounds` interleaved rounds of `steps` timed steps (the order of
the kinds rotates each round); step time is the median over all timed steps, and step / DDP the
median of the per-round ratios. Then, per kind, one step under `torch.profiler` (the chrome
trace of rank 0 is saved; it opens in Perfetto) gives the messages and bytes each rank sends
(from the trace's collectives and point-to-point ops, by the ring algorithms' volumes; RTP's
from its own counters) and RTP's exposed communication (time in its labelled `rtp.wait` ranges
over the step); one step under MemTracker gives the peak memory per rank. Every kind trains on
the same global batch per step, N batches of the preset's size: DDP, FSDP2 and RTP one per rank,
while tensor parallel ranks share all N (each rank computes its heads of the whole global
batch). The plot shows tokens/s and peak memory per rank.

With `hardware` (`--predict NAME|FILE.json`, a `cost.hardware` description such as the one
`rtp-compile calibrate` writes), each of DDP, FSDP2 and RTP also gets the time model's
predicted step and its error against the measured one.

    rtp-compile bench [--preset gpt-small|gpt2-124m|tiny|demo] [--world-sizes 2 4]
                      [--rounds 3] [--steps 3] [--out benchmarks/out] [--predict FILE.json]
                      (also: python benchmarks/speed.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_loss
from rtp_compile.compiler.transform import transform
from rtp_compile.core.tables import format_table
from rtp_compile.inspect.traces import profile_step
from rtp_compile.runtime import ring
from rtp_compile.runtime.launch import launch

KINDS = ("ddp", "fsdp2", "tp", "rtp")  # the default comparison
# also available through `kinds` (`--kinds`): RTP with `bucket_bytes="auto"` and, to compare it
# with like, RTP with the default buckets captured the same way (torch.export of one batch)
CHOICES = KINDS + ("rtp-export", "rtp-auto")
PRESETS = {  # name -> (model, sequences per batch, tokens per sequence)
    "gpt-small": (
        GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=8, n_embd=384),
        4,
        128,
    ),
    "gpt2-124m": (
        GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        1,
        128,
    ),
    "tiny": (GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32), 2, 16),
    "demo": (GPTConfig(n_layer=4, n_head=4, n_embd=256), 4, 32),  # `rtp-compile demo`'s
}
PREDICTED = ("ddp", "fsdp2", "rtp")  # the kinds the time model predicts (`cost.time`)
# bytes a rank sends per byte of the op's input, by the ring algorithms (gloo and NCCL)
_VOLUME = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "allreduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "allgather": lambda n: n - 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
}
_ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}


@dataclasses.dataclass(frozen=True)
class Setup:
    config: GPTConfig
    batch: int
    seq_len: int
    rounds: int
    steps: int
    trace_dir: str
    kinds: tuple[str, ...] = KINDS
    hardware: object = None  # the description "rtp-auto" plans for (None: its default)
    budget: int | None = None  # "rtp-auto"'s max_bytes_in_flight (None: the default's bound)

    @property
    def auto(self) -> dict:
        """transform's options for "rtp-auto" besides bucket_bytes."""
        return {"hardware": self.hardware, "max_bytes_in_flight": self.budget}


def head_parallel(model: TinyGPT, mesh) -> TinyGPT:
    """Megatron-style tensor parallelism of TinyGPT's blocks on `mesh`: each rank computes its
    heads (qkv rows reordered so a column shard holds the q, k and v of the same heads) and its
    slice of the MLP; the output projections all-reduce. Embeddings, norms and the head stay
    replicated (every rank computes them on the same batch)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = mesh.size()
    for block in model.blocks:
        attn = block.attn
        if attn.n_head % n:
            raise ValueError(f"tensor parallel: {attn.n_head} heads do not split over {n} ranks")
        with torch.no_grad():
            c = attn.qkv.out_features // 3
            order = torch.arange(3 * c).view(3, n, c // n).transpose(0, 1).reshape(-1)
            attn.qkv.weight.copy_(attn.qkv.weight[order])
            attn.qkv.bias.copy_(attn.qkv.bias[order])
        attn.n_head //= n
        parallelize_module(
            block,
            mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(),
            },
        )
    return model


def prepare(kind: str, rank: int, world_size: int, config: GPTConfig, device, example=None, **auto):
    """A fresh model (the same initial weights on every rank) prepared as `kind`; "rtp-export"
    and "rtp-auto" capture it with torch.export of `example` (a batch of token ids), the
    latter with `bucket_bytes="auto"` and `auto`'s options (`hardware`, `max_bytes_in_flight`)."""
    torch.manual_seed(0)
    model = TinyGPT(config).to(device)
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind in ("fsdp2", "tp"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world_size,))
        if kind == "tp":
            return head_parallel(model, mesh)
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return program(kind, model, world_size, example, **auto).module(rank)


def program(kind: str, model, world_size: int, example=None, **auto):
    """RTP's program for `kind` ("rtp", "rtp-export", "rtp-auto"; see `prepare`)."""
    if kind == "rtp":
        return transform(model, world_size)
    if example is None:
        raise ValueError(f"bench: kind {kind!r} captures the model with an example batch")
    if kind == "rtp-export":
        return transform(model, world_size, example_inputs=(example,))
    if kind == "rtp-auto":
        return transform(model, world_size, example_inputs=(example,), bucket_bytes="auto", **auto)
    raise ValueError(f"bench: unknown kind {kind!r} (one of {', '.join(CHOICES)})")


def example_batch(setup) -> torch.Tensor:
    """One per-rank batch of token ids (what the export kinds are captured with)."""
    return torch.zeros(setup.batch, setup.seq_len, dtype=torch.long)


def _comm_of(trace: list[dict], world_size: int) -> tuple[int, float]:
    """(messages, bytes this rank sent) from a profiler trace's communication ops."""
    messages, sent = 0, 0.0
    for event in trace:
        name = event.get("name", "")
        if not name.startswith(("gloo:", "nccl:")):
            continue
        op = name.split(":", 1)[1]
        volume = next((f for key, f in _VOLUME.items() if key in op), None)
        if volume is None:  # broadcasts (buffers) and barriers: no training traffic
            continue
        args = event.get("args", {})
        elements = sum(_numel(d) for d in args.get("Input Dims", []))
        itemsize = next((_ITEMSIZE.get(t, 4) for t in args.get("Input type", [])), 4)
        messages += 1
        sent += elements * itemsize * volume(world_size)
    return messages, sent


def _numel(dims) -> int:
    if dims and isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        n *= d
    return n


def measure(rank: int, world_size: int, setup: Setup) -> dict:
    """Per kind, on this rank: timed steps per round, then one profiled and one tracked step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    cfg, kinds = setup.config, setup.kinds
    example = example_batch(setup).to(device)
    models = {k: prepare(k, rank, world_size, cfg, device, example, **setup.auto) for k in kinds}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    gens = {k: torch.Generator().manual_seed(0 if k == "tp" else rank + 1) for k in kinds}
    # the same global batch for every kind: tensor parallel ranks share the N batches
    batches = {k: setup.batch * (world_size if k == "tp" else 1) for k in kinds}

    def step(kind):
        idx = torch.randint(
            0, cfg.vocab_size, (batches[kind], setup.seq_len + 1), generator=gens[kind]
        ).to(device)
        dist.barrier()
        start = time.perf_counter()
        lm_loss(models[kind](idx[:, :-1]), idx[:, 1:]).backward()
        opts[kind].step()
        opts[kind].zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(kinds) * (setup.rounds + 3), desc=f"N={world_size}", leave=False)
    times = {k: [] for k in kinds}
    for kind in kinds:
        step(kind)  # warm-up: optimizer state, first-call costs
        bar and bar.update()
    for r in range(setup.rounds):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            times[kind].append([step(kind) for _ in range(setup.steps)])
            bar and bar.update()
    out = {
        k: {
            "rounds": [statistics.median(t) for t in times[k]],
            "all": [s for t in times[k] for s in t],
        }
        for k in kinds
    }
    for kind in kinds:
        hops, sent = ring.traffic["hops"], ring.traffic["bytes"]
        path = pathlib.Path(setup.trace_dir) / f"trace_{kind}_N{world_size}_rank{rank}.json"
        seconds, trace = profile_step(
            lambda: step(kind), path, cuda=device.type == "cuda", record_shapes=True
        )
        if rank:
            path.unlink()  # rank 0's trace is kept
        if kind.startswith("rtp"):
            messages, bytes_sent = ring.traffic["hops"] - hops, ring.traffic["bytes"] - sent
            waiting = (
                sum(e.get("dur", 0) for e in trace if e.get("name", "").startswith("rtp.wait"))
                * 1e-6
            )
            out[kind]["exposed"] = waiting / seconds
        else:
            messages, bytes_sent = _comm_of(trace, world_size)
        out[kind].update(messages=messages, bytes=bytes_sent)
        bar and bar.update()
    for kind in kinds:
        tracker = MemTracker()
        tracker.track_external(models[kind], opts[kind])
        with tracker:
            step(kind)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        out[kind]["peak"] = peak["Total"]
        bar and bar.update()
    bar and bar.close()
    return out


def exported_programs(setup: Setup, world_size: int) -> dict:
    """The setup's torch.export kinds ("rtp-export", "rtp-auto") as the ranks build them:
    kind -> `RTPProgram` (for the predictions and the auto choice, built once per N)."""
    out = {}
    for kind in setup.kinds:
        if kind in ("rtp-export", "rtp-auto"):
            torch.manual_seed(0)
            out[kind] = program(
                kind, TinyGPT(setup.config), world_size, example_batch(setup), **setup.auto
            )
    return out


def predict(setup: Setup, world_size: int, hardware, exported: dict) -> dict:
    """The time model's step of each of the setup's kinds it predicts (DDP, FSDP2, RTP and
    the `exported` programs) on the bench's model and per-rank batch: kind ->
    `cost.time.StepTime`."""
    from rtp_compile import cost

    b, s = setup.batch, setup.seq_len
    out = {kind: p.cost(b, s, hardware=hardware).time for kind, p in exported.items()}
    if any(kind in setup.kinds for kind in PREDICTED):
        torch.manual_seed(0)
        prog = transform(TinyGPT(setup.config), world_size)
        for kind, f in zip(PREDICTED, (cost.ddp, cost.fsdp, cost.rtp)):
            if kind in setup.kinds:
                out[kind] = f(prog, b, s, hardware=hardware).time
    return out


def run(
    world_sizes=(2, 4),
    preset: str = "gpt-small",
    rounds: int = 3,
    steps: int = 3,
    out: str = "benchmarks/out",
    batch: int | None = None,
    seq_len: int | None = None,
    hardware=None,
    kinds=KINDS,
    budget: int | None = None,
) -> list[dict]:
    """Measure every kind (of `CHOICES`) at every world size; print the table, save the plot
    and traces; return the rows (`vs_first`: step / the first kind's, DDP's by default; with
    `hardware`: each predicted kind's `predicted_ms` and `error`)."""
    config, default_batch, default_seq = PRESETS[preset]
    unknown = [k for k in kinds if k not in CHOICES]
    if unknown or not kinds:
        raise ValueError(f"bench: unknown kinds {unknown} (choose from {', '.join(CHOICES)})")
    setup = Setup(
        config,
        batch or default_batch,
        seq_len or default_seq,
        rounds,
        steps,
        out,
        tuple(kinds),
        hardware,
        budget,
    )
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    rows = []
    for n in world_sizes:
        ranks = launch(
            measure, n, args=(setup,), timeout=1800, env={"KINETO_LOG_LEVEL": "6"}
        )  # no profiler start/stop lines
        exported = exported_programs(setup, n)
        if "rtp-auto" in exported:
            print(f"N={n}: {exported['rtp-auto'].ctx.bucket_choice}")
        predicted = predict(setup, n, hardware, exported) if hardware else {}
        first = ranks[0][setup.kinds[0]]["rounds"]
        for kind in setup.kinds:
            per_rank = [r[kind] for r in ranks]
            step_s = statistics.median(per_rank[0]["all"])
            ratios = [k / d for k, d in zip(per_rank[0]["rounds"], first)]
            tokens = setup.batch * setup.seq_len * n  # the global batch, every kind
            rows.append(
                {
                    "N": n,
                    "kind": kind,
                    "step_ms": step_s * 1e3,
                    "tokens_per_s": tokens / step_s,
                    "vs_first": statistics.median(ratios),
                    "peak_mb": max(r["peak"] for r in per_rank) / 1e6,
                    "sent_mb": max(r["bytes"] for r in per_rank) / 1e6,
                    "messages": max(r["messages"] for r in per_rank),
                    "exposed": per_rank[0].get("exposed"),
                }
            )
            if kind in predicted:
                rows[-1]["predicted_ms"] = predicted[kind].step_s * 1e3
                rows[-1]["error"] = rows[-1]["predicted_ms"] / rows[-1]["step_ms"] - 1
    print(
        f"{preset}: {config.n_layer} layers x {config.n_embd} wide, vocab {config.vocab_size}, "
        f"global batch N x {setup.batch} x {setup.seq_len} tokens per step (tensor parallel: "
        f"shared by its ranks), AdamW; {rounds} interleaved rounds "
        f"of {steps} steps; {dist.Backend.GLOO if not torch.cuda.is_available() else 'nccl'}"
    )
    print(
        format_table(
            [
                (
                    "N",
                    "kind",
                    "step ms",
                    "tokens/s",
                    f"step / {setup.kinds[0]}",
                    "peak MB/rank",
                    "sent MB/rank",
                    "messages",
                    "exposed comm",
                )
                + (("predicted ms", "error") if hardware else ())
            ]
            + [
                (
                    r["N"],
                    r["kind"],
                    f"{r['step_ms']:.1f}",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['vs_first']:.2f}",
                    f"{r['peak_mb']:.2f}",
                    f"{r['sent_mb']:.2f}",
                    r["messages"],
                    "-" if r["exposed"] is None else f"{r['exposed']:.0%}",
                )
                + (
                    (
                        (f"{r['predicted_ms']:.1f}", f"{r['error']:+.0%}")
                        if "error" in r
                        else ("-", "-")
                    )
                    if hardware
                    else ()
                )
                for r in rows
            ]
        )
    )
    print(
        "per step and rank; messages: collectives and sends (RTP: ring hops); exposed comm: "
        "RTP's time waiting on ring receives / step time"
    )
    _plot(rows, setup.kinds, pathlib.Path(out))
    print(f"traces (rank 0, Perfetto): {out}/trace_<kind>_N<n>_rank0.json")
    return rows


def _plot(rows: list[dict], kinds, out: pathlib.Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is missing (pip install 'rtp_compile[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        mine = [next(r for r in rows if r["N"] == n and r["kind"] == kind) for n in sizes]
        where = [j + i * width for j in range(len(sizes))]
        axes[0].bar(where, [r["tokens_per_s"] for r in mine], width, label=kind)
        axes[1].bar(where, [r["peak_mb"] for r in mine], width, label=kind)
    for ax, label in zip(axes, ("tokens/s (the same global batch)", "peak MB per rank")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"N={n}" for n in sizes])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=120)
    print(f"plot: {out / 'speed.png'}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt-small")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per kind and round")
    parser.add_argument("--batch", type=int, help="sequences per batch (preset's default)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (preset's default)")
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=CHOICES,
        default=list(KINDS),
        help="what to compare (the first is the ratios' base); rtp-auto: bucket_bytes='auto' "
        "(on --predict's description), rtp-export: default buckets, captured the same way",
    )
    parser.add_argument(
        "--budget", type=int, help="rtp-auto's max_bytes_in_flight (default: the default's bound)"
    )
    parser.add_argument(
        "--predict", metavar="HARDWARE", help="also the time model's step on this description"
    )
    args = parser.parse_args(argv)
    return run(
        args.world_sizes,
        args.preset,
        args.rounds,
        args.steps,
        args.out,
        args.batch,
        args.seq_len,
        args.predict,
        args.kinds,
        args.budget,
    )
