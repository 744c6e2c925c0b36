"""Command line of rtp_compile: `rtp-compile demo` trains the demo, `rtp-compile inspect` shows
what the compiler makes of a model (plan, per-op report, one rank's generated code)."""
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
    """The argument parser with the `demo` and `inspect` subcommands."""
    parser = argparse.ArgumentParser(
        prog="rtp-compile",
        description="Compile PyTorch models for Rotated Tensor Parallel training.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo", help="train TinyGPT with RTP next to DDP on local CPU ranks and compare")
    demo.add_argument("--world-size", type=_positive_int, default=2, help="ranks (default 2)")
    demo.add_argument("--steps", type=_positive_int, default=60, help="AdamW steps (default 60)")
    demo.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    demo.set_defaults(run=_run_demo)

    inspect = commands.add_parser(
        "inspect", help="print the sharding plan, op report and a rank's code for a model")
    inspect.add_argument("target", metavar="MODULE:FACTORY",
                         help="importable module and a callable in it returning an nn.Module")
    inspect.add_argument("--world-size", type=_positive_int, required=True, help="ranks")
    inspect.add_argument("--rank", type=int, default=0, help="rank whose code to print (default 0)")
    inspect.set_defaults(run=_run_inspect)
    return parser


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _run_demo(args: argparse.Namespace) -> None:
    """`demo`: run the RTP-vs-DDP training demo."""
    from rtp_compile.demo import run_demo  # lazy: `inspect` needs no training code

    run_demo(world_size=args.world_size, steps=args.steps, seed=args.seed)


def _run_inspect(args: argparse.Namespace) -> None:
    """`inspect`: compile the model a factory returns and print plan, report and rank code."""
    import rtp_compile

    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank must be in [0, {args.world_size}), got {args.rank}")
    model = load_model(args.target)
    prog = rtp_compile.transform(model, args.world_size)
    print(prog.plan)
    print()
    print(prog.report())
    print()
    print(f"# module of rank {args.rank} of {args.world_size}: its units, then its code")
    print(prog.module(args.rank))


def load_model(target: str) -> nn.Module:
    """Import MODULE, call FACTORY() from `target` = "MODULE:FACTORY"; UsageError if that fails."""
    module_name, sep, factory_name = target.partition(":")
    if not sep or not module_name or not factory_name:
        raise UsageError(f"expected MODULE:FACTORY (e.g. rtp_compile.models:TinyGPT), "
                         f"got {target!r}")
    # The console script's sys.path lacks the working directory that `python -m` would add.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a module failing at import time is as unusable as a missing one
        raise UsageError(f"cannot import module {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from exc
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
