"""The measurement behind the rank-graph choice (docs/design.md, "The backward in the graph"):
three ways to run L rotated column linears (+ GELU) on rank 0 of N under a `fake` process group
(communication free), against the unsharded layers, eager and `torch.compile(fullgraph=True)`:

- **today**: the rank program `rtp_compile.transform` emits (each unit's backward one opaque op
  that runs its event list in eager Python);
- **autograd-through-funcol** (the joint-graph route): the forward written with
  `funcol.permute_tensor`, whose adjoint is the reverse rotation, and autograd left to derive
  the backward (it saves every received shard: the whole weight);
- **traceable Function**: a `torch.autograd.Function` whose forward rotates and whose backward
  re-fetches the shards counter-clockwise and passes the gradient accumulator, both with
  `funcol.permute_tensor` (it saves x and the own shard only), so Dynamo traces the backward
  into the AOT backward graph.

Each (N, mode) runs in its own process; after warm-up, 7 interleaved rounds of 5 AdamW steps;
the medians per step and their ratio to the unsharded step are printed.

    python benchmarks/backward_choice.py [--world-sizes 2 4 8] [--modes eager compiled]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time

import torch

LAYERS, WIDTH, ROWS = 8, 64, 512
KINDS = ("unsharded", "today", "autograd-through-funcol", "traceable Function")


def build(world_size: int, rank: int = 0) -> dict[str, torch.nn.Module]:
    """The four modules on the same initial weights (under an initialised process group)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import rtp_compile

    group = dist.group.WORLD
    clockwise = [(i + 1) % world_size for i in range(world_size)]  # rank i sends to i + 1
    counter = [(i - 1) % world_size for i in range(world_size)]

    def hop(t: torch.Tensor, ring: list[int]) -> torch.Tensor:
        return funcol.permute_tensor(t.reshape(-1), ring, group).view(t.shape)

    def rotated_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ W.t() from the own row shard w, by N - 1 clockwise hops."""
        outs: list = [None] * world_size
        held = w
        for k in range(world_size):
            outs[(rank - k) % world_size] = x @ held.t()
            if k < world_size - 1:
                held = hop(held, clockwise)
        return torch.cat(outs, -1)

    class RotatedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return rotated_forward(x, w)

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            dys = dy.chunk(world_size, -1)
            dx, acc, held = None, None, w
            for j in range(world_size):  # step j holds shard r + 1 + j, the last its own
                s = (rank + 1 + j) % world_size
                held = hop(held, counter) if j < world_size - 1 else w
                part, grad = dys[s] @ held, dys[s].t() @ x
                dx = part if dx is None else dx + part
                acc = grad if acc is None else acc + grad
                if j < world_size - 1:
                    acc = hop(acc, counter)  # on to r - 1: complete at the owner
            return dx, acc

    class Unsharded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)
            )

        def forward(self, x):
            for layer in self.layers:
                x = torch.nn.functional.gelu(layer(x))
            return x

    class Sharded(torch.nn.Module):
        def __init__(self, full: Unsharded, traceable: bool):
            super().__init__()
            self.traceable = traceable
            self.ws = torch.nn.ParameterList(
                torch.nn.Parameter(f.weight.detach().chunk(world_size, 0)[rank].clone())
                for f in full.layers
            )

        def forward(self, x):
            for w in self.ws:
                y = RotatedLinear.apply(x, w) if self.traceable else rotated_forward(x, w)
                x = torch.nn.functional.gelu(y)
            return x

    torch.manual_seed(0)
    full = Unsharded()
    return {
        "unsharded": copy.deepcopy(full),
        "today": rtp_compile.transform(copy.deepcopy(full), world_size).module(rank),
        "autograd-through-funcol": Sharded(full, traceable=False),
        "traceable Function": Sharded(full, traceable=True),
    }


def measure(world_size: int, mode: str) -> dict[str, float]:
    """In a fresh process: the median ms per AdamW step of each kind."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    modules = build(world_size)
    if mode == "compiled":
        modules = {k: torch.compile(m, fullgraph=True) for k, m in modules.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in modules.items()}
    x = torch.randn(ROWS, WIDTH)

    def step(kind: str) -> float:
        start = time.perf_counter()
        modules[kind](x).square().mean().backward()
        opts[kind].step()
        opts[kind].zero_grad()
        return time.perf_counter() - start

    for _ in range(3):
        for kind in KINDS:
            step(kind)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(7):
        for kind in KINDS[r % 4 :] + KINDS[: r % 4]:
            times[kind].append(statistics.median(step(kind) for _ in range(5)))
    dist.destroy_process_group()
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # N MODE
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1])))
        return
    from rtp_compile.core.tables import format_table

    rows = [["mode", "N", *[f"{k} ms" for k in KINDS], *[f"{k} / unsharded" for k in KINDS[1:]]]]
    for mode in args.modes:
        for n in args.world_sizes:
            done = subprocess.run(
                [sys.executable, __file__, "--one", str(n), mode],
                capture_output=True,
                text=True,
                timeout=1200,
            )
            if done.returncode:
                raise RuntimeError(f"{mode} N={n} failed:\n{done.stderr}")
            ms = json.loads(done.stdout.splitlines()[-1])
            rows.append(
                [mode, n, *[f"{ms[k]:.2f}" for k in KINDS]]
                + [f"{ms[k] / ms['unsharded']:.2f}" for k in KINDS[1:]]
            )
    print(
        f"{LAYERS} rotated column linears {WIDTH} wide + GELU, {ROWS} rows, AdamW, rank 0 of N "
        "under a fake process group (communication free)"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
