"""Command line of rtp_compile: `rtp-compile demo` trains TinyGPT on Shakespeare next to DDP,
`rtp-compile inspect` shows what the compiler makes of a model (plan, per-op report, one rank's
generated code), `rtp-compile plan` predicts per-rank memory (with `--hardware`, step time
too) of models far larger than this machine (built on the meta device), `rtp-compile bench`
measures step time, memory and traffic next to DDP, FSDP2 and DTensor tensor parallel
(`--memory`: memory by category next to the cost model; `--predict`: the time model's step
next to the measured one), `rtp-compile calibrate` measures this machine (compute, gloo
communication, the runtime's per-step cost) and writes the hardware description the time
model loads."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from torch import nn


class UsageError(Exception):
    """A problem with what the user asked for; reported as one line and exit code 2."""


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]), run the subcommand, return its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except UsageError as exc:
        parser.exit(2, f"rtp-compile {args.command}: error: {exc}\n")
    except BrokenPipeError:  # `rtp-compile inspect ... | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _parser() -> argparse.ArgumentParser:
    """The argument parser with its subcommands (demo, inspect, plan, bench, calibrate)."""
    parser = argparse.ArgumentParser(
        prog="rtp-compile",
        description="Compile PyTorch models for Rotated Tensor Parallel training.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train TinyGPT on Shakespeare with RTP next to DDP on local CPU ranks, "
        "compare, and sample text from it",
    )
    demo.add_argument("--world-size", type=_positive_int, default=2, help="ranks (default 2)")
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=400,
        help="AdamW steps (default 400, about a minute on 2 CPU cores)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    demo.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="the model's dtype (default float32; float64 shows RTP and DDP agree "
        "to rounding over the whole run)",
    )
    demo.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save the RTP program and the DDP replica there (DCP checkpoints) "
        "every --checkpoint-every steps",
    )
    demo.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        default=100,
        help="steps between checkpoints (default 100)",
    )
    demo.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --checkpoint-dir up to --steps",
    )
    demo.set_defaults(run=_run_demo)

    inspect = commands.add_parser(
        "inspect",
        help="print the sharding plan, op report, a rank's code and the predicted "
        "memory for a model (--draw: its schedule drawn)",
    )
    inspect.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        help="importable module and a callable in it returning an nn.Module",
    )
    inspect.add_argument("--world-size", type=_positive_int, required=True, help="ranks")
    inspect.add_argument("--rank", type=int, default=0, help="rank whose code to print (default 0)")
    inspect.add_argument(
        "--batch-size",
        type=_positive_int,
        default=1,
        help="per-rank batch the cost is predicted for (default 1)",
    )
    inspect.add_argument(
        "--seq-len",
        type=_positive_int,
        default=32,
        help="tokens per sequence the cost is predicted for (default 32)",
    )
    inspect.add_argument(
        "--draw",
        metavar="PATH",
        help="also draw the rank's forward schedule to PATH (.svg, .png or .pdf; needs matplotlib)",
    )
    inspect.set_defaults(run=_run_inspect)

    plan = commands.add_parser(
        "plan",
        help="predict per-rank memory of DDP, FSDP2 and RTP for models built on the "
        "meta device (never materialised)",
    )
    plan.add_argument(
        "targets",
        nargs="+",
        metavar="MODEL",
        help="a preset (llama-7b, llama-13b, llama-70b, llama-3.1-8b, llama-3.1-70b, "
        "llama-3.1-405b) or MODULE:FACTORY, "
        "called under torch.device('meta')",
    )
    plan.add_argument("--world-sizes", type=_positive_int, nargs="+", default=[8, 16, 64])
    plan.add_argument("--batch-size", type=_positive_int, default=1, help="per rank (default 1)")
    plan.add_argument("--seq-len", type=_positive_int, default=2048, help="(default 2048)")
    plan.add_argument(
        "--dtype", default="bfloat16", help="parameter and activation dtype (default bfloat16)"
    )
    plan.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, ...")
    plan.add_argument(
        "--hardware",
        metavar="NAME|FILE.json",
        help="also the predicted step time of each kind on this hardware: a shipped "
        "description (h100-nvlink, a100-nvlink, this-cpu) or a JSON file (rtp-compile "
        "calibrate writes one)",
    )
    plan.set_defaults(run=_run_plan)

    bench = commands.add_parser(
        "bench",
        help="DDP / FSDP2 / DTensor TP / RTP side by side, measured: step time, "
        "tokens/s, peak memory, traffic (--memory: the memory benchmark)",
    )
    bench.add_argument(
        "--memory",
        action="store_true",
        help="instead: per-rank memory of one AdamW step (MemTracker) by "
        "category, DDP / FSDP2 / RTP, N = 2 and 4, next to the cost model",
    )
    bench.add_argument(
        "--overhead",
        action="store_true",
        help="instead: the runtime's cost without communication (fake process group): rank "
        "step / unsharded step, eager and compiled, N = 2, 4, 8 (a 2 x 64 GPT)",
    )
    bench.add_argument(
        "--predict",
        nargs="?",
        const="this-cpu",
        metavar="HARDWARE",
        help="instead: the time model against measurement: each kind's predicted step next to "
        "the measured one, gpt-small and demo, N = 2 and 4 (HARDWARE: a description, "
        "default this-cpu; rtp-compile calibrate writes a fresh one)",
    )
    bench.add_argument(
        "--buckets",
        nargs="?",
        const="this-cpu",
        metavar="HARDWARE",
        help="instead: bucket_bytes='auto' (planned on HARDWARE, default this-cpu) against the "
        "default buckets, both captured with torch.export: step time, peak, predictions",
    )
    bench.add_argument(
        "--budget",
        type=_positive_int,
        metavar="BYTES",
        help="with --buckets: the memory budget auto chooses under (max_bytes_in_flight; "
        "default: what the default buckets hold)",
    )
    bench.add_argument(
        "--kinds",
        nargs="+",
        help="what to compare, the first the ratios' base (default ddp fsdp2 tp rtp; also "
        "rtp-export, rtp-auto)",
    )
    bench.add_argument(
        "--preset",
        default="gpt-small",
        help="model and batch: gpt-small (default), gpt2-124m, tiny, demo",
    )
    bench.add_argument(
        "--world-sizes",
        type=_positive_int,
        nargs="+",
        help="(default 2 4; --overhead: 2 4 8)",
    )
    bench.add_argument("--rounds", type=_positive_int, default=3, help="interleaved rounds")
    bench.add_argument(
        "--steps", type=_positive_int, default=3, help="timed steps per kind and round"
    )
    bench.add_argument("--out", default="benchmarks/out", help="where the plot and traces go")
    bench.set_defaults(run=_run_bench)

    calibrate = commands.add_parser(
        "calibrate",
        help="measure this machine for the time model (matmul FLOP/s, memory bandwidth, "
        "op dispatch, gloo ring hop and collectives fitted as a + b * bytes, the runtime's "
        "per-step cost) and write its hardware description JSON",
    )
    calibrate.add_argument(
        "--world-sizes",
        type=_positive_int,
        nargs="+",
        default=[2, 4],
        help="local ranks measured at once, each >= 2 (default 2 4)",
    )
    calibrate.add_argument(
        "--out",
        default="benchmarks/out/hardware-this-cpu.json",
        help="the JSON file written (default benchmarks/out/hardware-this-cpu.json)",
    )
    calibrate.add_argument(
        "--name", default="this-cpu", help="the hardware's name in the file (default this-cpu)"
    )
    calibrate.add_argument(
        "--quick", action="store_true", help="few sizes and repeats (seconds; noisier)"
    )
    calibrate.set_defaults(run=_run_calibrate)
    return parser


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _run_demo(args: argparse.Namespace) -> None:
    """`demo`: run the RTP-vs-DDP training demo."""
    import torch

    from rtp_compile.apps.demo import run_demo  # lazy: `inspect` needs no training code

    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir, the directory to resume from")
    run_demo(
        world_size=args.world_size,
        steps=args.steps,
        seed=args.seed,
        dtype=getattr(torch, args.dtype),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )


def _run_inspect(args: argparse.Namespace) -> None:
    """`inspect`: compile the model a factory returns and print plan, report, rank code and
    cost; draw the rank's schedule if asked."""
    from rtp_compile.compiler.transform import transform
    from rtp_compile.inspect.draw import FORMATS

    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank must be in [0, {args.world_size}), got {args.rank}")
    if args.draw and not args.draw.lower().endswith(FORMATS):
        raise UsageError(
            f"--draw writes {', '.join(FORMATS)} by the path's suffix, got {args.draw!r}"
        )
    model = load_model(args.target)
    prog = transform(model, args.world_size)
    print(prog.plan)
    print()
    print(prog.report())
    print()
    print(f"# module of rank {args.rank} of {args.world_size}: its units, then its code")
    print(prog.module(args.rank))
    print()
    try:
        print(prog.cost(args.batch_size, args.seq_len))
    except ValueError as err:  # inputs whose shapes the cost model cannot tell
        print(f"cost not predicted: {err}")
    if args.draw:
        print(f"\nschedule of rank {args.rank} drawn: {prog.draw(args.rank, args.draw)}")


def _run_plan(args: argparse.Namespace) -> None:
    """`plan`: capture each model on the meta device once, print the three kinds' costs for
    every world size, how exact RTP's parameter bytes are, and what planning took."""
    import resource
    import time

    import torch

    from rtp_compile.apps.presets import LLAMA, meta_model
    from rtp_compile.compiler.transform import transform
    from rtp_compile.cost import table

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype must name a torch dtype (e.g. bfloat16), got {args.dtype!r}")
    hardware = None
    if args.hardware:
        from rtp_compile.cost.hardware import load

        try:
            hardware = load(args.hardware)
        except ValueError as e:
            raise UsageError(str(e)) from e
    for target in args.targets:
        start = time.perf_counter()
        if target in LLAMA:
            model = meta_model(target, dtype)
        else:
            with torch.device("meta"):
                model = load_model(target).to(dtype)
        prog = transform(model, args.world_sizes[0])
        n_params = sum(p.numel() for p in prog.ctx.params.values())
        print(
            f"{target}: {n_params / 1e9:.2f} B parameters ({args.dtype}), "
            f"{len(prog.plan.units)} units"
        )
        print(
            table(
                prog,
                args.batch_size,
                args.seq_len,
                args.world_sizes,
                args.optimizer,
                hardware=hardware,
            )
        )
        for n in args.world_sizes:
            held = (
                prog.for_world_size(n)
                .cost(args.batch_size, args.seq_len, args.optimizer)
                .param_bytes
            )
            print(
                f"  N={n}: RTP parameter bytes per rank {held:,} = "
                f"{held / (n_params * dtype.itemsize / n):.4f} x full/N"
            )
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        print(f"  planned in {time.perf_counter() - start:.0f} s, peak RSS {rss:.2f} GiB\n")


def _run_bench(args: argparse.Namespace) -> None:
    """`bench`: the side-by-side speed benchmark (`rtp_compile.apps.bench_speed`); `bench --memory`:
    the measured memory benchmark (`rtp_compile.apps.bench_memory`)."""
    if args.memory:
        from rtp_compile.apps.bench_memory import main as bench_memory

        bench_memory(["--out", args.out])
        return
    if args.overhead:
        from rtp_compile.apps.bench_overhead import run as bench_overhead

        bench_overhead(args.world_sizes or [2, 4, 8], args.rounds, args.steps)
        return
    if args.predict:
        from rtp_compile.apps.bench_time import run as bench_time

        bench_time(
            hardware=args.predict,
            world_sizes=args.world_sizes or [2, 4],
            rounds=args.rounds,
            steps=args.steps,
            out=args.out,
        )
        return
    from rtp_compile.apps.bench_speed import CHOICES, KINDS, PRESETS, run

    if args.preset not in PRESETS:
        raise UsageError(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    kinds = ("rtp-export", "rtp-auto") if args.buckets else tuple(args.kinds or KINDS)
    if any(k not in CHOICES for k in kinds):
        raise UsageError(f"--kinds must be among {', '.join(CHOICES)}, got {' '.join(kinds)}")
    run(
        args.world_sizes or [2, 4],
        args.preset,
        args.rounds,
        args.steps,
        args.out,
        hardware=args.buckets,
        kinds=kinds,
        budget=args.budget,
    )


def _run_calibrate(args: argparse.Namespace) -> None:
    """`calibrate`: the micro-benchmarks of `rtp_compile.apps.calibrate`, written as JSON."""
    if min(args.world_sizes) < 2:
        raise UsageError(
            f"--world-sizes must be >= 2 (a ring needs a peer), got {args.world_sizes}"
        )
    from rtp_compile.apps.calibrate import run

    run(args.world_sizes, args.out, args.name, args.quick)


def load_model(target: str) -> nn.Module:
    """Import MODULE, call FACTORY() from `target` = "MODULE:FACTORY"; UsageError if that fails."""
    module_name, sep, factory_name = target.partition(":")
    if not sep or not module_name or not factory_name:
        raise UsageError(
            f"expected MODULE:FACTORY (e.g. rtp_compile.apps.models:TinyGPT), got {target!r}"
        )
    # The console script's sys.path lacks the working directory that `python -m` would add.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a module failing at import time is as unusable as a missing one
        raise UsageError(
            f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UsageError(f"module {module_name!r} has no callable {factory_name!r}")
    try:
        model = factory()
    except Exception as exc:
        raise UsageError(f"{target}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(f"{target}() returned {type(model).__name__}, not a torch.nn.Module")
    return model
