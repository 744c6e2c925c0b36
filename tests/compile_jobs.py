"""What the compile tests run on every rank of a real job (rtp_compile.launch, gloo): a rank's
module trained next to the same rank's module under `torch.compile(..., fullgraph=True)`."""

from __future__ import annotations

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from jobs import loss_of, rel_err
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from zoo import batch, build

import rtp_compile
from rtp_compile.apps.models import GPTConfig, TinyGPT
from rtp_compile.runtime.bucket import BucketRuntime
from rtp_compile.runtime.gathered import GatheredOpRuntime
from rtp_compile.runtime.recompute import CheckpointedRegion

LR = 1e-2


def tiny_gpt(seed: int, dtype: torch.dtype) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=48, block_size=16, n_layer=1, n_head=2, n_embd=32)).to(
        dtype
    )


def gpt_batch(seed: int, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + step)
    return torch.randint(0, 48, (2, 16), generator=g)


def _received(node: fx.Node) -> bool:
    """`node` is what a ring hop received (a `ring_wait` result), or a view of it."""
    while node.op == "call_function":
        if node.target is torch.ops.rtp.ring_wait.default:
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return False
        node = node.args[0]
    return False


def aot_eager_watching(received: dict):
    """aot_eager (min-cut partitioner, the graphs run as traced) that records in `received`
    how many tensors of the compiled forward a ring hop received ("in forward") and which of
    them it saves for backward ("saved"; none may be: weights are re-fetched,
    never saved), and the rtp ops of the compiled backward ("backward ops": op name -> count).
    """

    def forward(gm, example_inputs):
        received["in forward"] += sum(map(_received, gm.graph.nodes))
        received["saved"] += [
            o.name
            for o in gm.graph.output_node().args[0]
            if isinstance(o, fx.Node) and _received(o)
        ]
        return make_boxed_func(gm.forward)

    def backward(gm, example_inputs):
        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and name.startswith("rtp."):
                ops = received["backward ops"]
                ops[name] = ops.get(name, 0) + 1
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=forward,
            bw_compiler=backward,
            partition_fn=min_cut_rematerialization_partition,
        )

    return backend


def compiled_next_to_eager(
    rank: int, model, make_batch, backend, steps: int, seed: int, **options
) -> dict:
    """`steps` of forward, backward and AdamW on rank `rank`'s module and on another copy of
    it compiled whole; the largest relative errors of the compiled one's outputs, gradients
    (of the first step, and of the later ones: after an AdamW step, whose first update
    amplifies rounding, so later outputs and gradients are apart by more) and (after the steps)
    parameters and buffers; the frames dynamo compiled (one: no break, no recompile); how many
    buckets, gathered ops and activation checkpoints the module has."""
    prog = rtp_compile.transform(model, 2, **options)
    eager, plain = prog.module(rank), prog.module(rank)
    received: dict = {"in forward": 0, "saved": [], "backward ops": {}}
    counter = CompileCounterWithBackend(
        aot_eager_watching(received) if backend == "aot_eager" else backend
    )
    compiled = torch.compile(plain, backend=counter, fullgraph=True)
    # eps=1e-3: Adam's first update is lr*g/(|g|+eps), whose slope at g = 0 is lr/eps. With
    # eps=1e-6 a float32 rounding difference (1e-7) in a near-zero gradient of the tied
    # embedding became a 2e-3 parameter difference, and outputs after the step 1.2e-2 apart
    # (seed 384218). With 1e-3 the slope is 10: a rounding difference stays rounding.
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, eps=1e-3) for m in (eager, plain)]
    errors = {
        "output": 0.0,
        "grad": 0.0,
        "output after a step": 0.0,
        "grad after a step": 0.0,
        "param": 0.0,
    }
    for step in range(steps):
        x = make_batch(step)
        outs = [module(x) for module in (eager, compiled)]
        for out in outs:
            loss_of(out, seed + step).backward()
        after = "" if step == 0 else " after a step"
        errors["output" + after] = max(errors["output" + after], rel_err(outs[1], outs[0]))
        for (name, p), q in zip(eager.named_parameters(), plain.parameters()):
            assert q.grad is not None, f"compiled module: no gradient for {name}"
            errors["grad" + after] = max(errors["grad" + after], rel_err(q.grad, p.grad, 1e-6))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    errors["param"] = max(
        rel_err(q.float(), p.float(), LR)
        for p, q in zip(
            [*eager.parameters(), *eager.buffers()], [*plain.parameters(), *plain.buffers()]
        )
    )
    kinds = (BucketRuntime, GatheredOpRuntime, CheckpointedRegion)
    return {
        **errors,
        "frames": counter.frame_count,
        "received": received,
        **{kind.__name__: sum(isinstance(m, kind) for m in plain.modules()) for kind in kinds},
    }


def aot_eager_models(rank: int, world_size: int, seed: int) -> dict:
    """Float64, compiled with aot_eager (functionalization and the partitioner, no code
    generation): TinyGPT with buckets (the default) and without; models with gathered ops,
    with activation checkpoints, with BatchNorm (buffers broadcast and updated in place)."""
    gpt = tiny_gpt(seed, torch.float64)
    out = {
        "gpt": compiled_next_to_eager(
            rank, gpt, lambda s: gpt_batch(seed, rank, s), "aot_eager", 2, seed
        ),
        "gpt, no buckets": compiled_next_to_eager(
            rank, gpt, lambda s: gpt_batch(seed, rank, s), "aot_eager", 2, seed, bucket_bytes=0
        ),
    }
    for name in ("norule", "checkpointed", "conv"):
        out[name] = compiled_next_to_eager(
            rank, build(name, seed), lambda s: batch(name, seed, rank, s), "aot_eager", 2, seed
        )
    return out


def inductor_gpt(rank: int, world_size: int, seed: int) -> dict:
    """TinyGPT in float32 through the default backend (inductor's C++ code)."""
    return compiled_next_to_eager(
        rank, tiny_gpt(seed, torch.float32), lambda s: gpt_batch(seed, rank, s), "inductor", 2, seed
    )


def many_modules(rank: int, world_size: int, seed: int, count: int) -> list[int]:
    """The frames each of `count` rank modules of one program compiles (eager backend): dynamo
    compiles at most `recompile_limit` (8) frames of one code object, so if anything these
    modules share (their hooks) were compiled per module, fullgraph would fail."""
    prog = rtp_compile.transform(build("mlp", seed), world_size)
    x = batch("mlp", seed, rank)
    frames = []
    for _ in range(count):
        counter = CompileCounterWithBackend("eager")
        torch.compile(prog.module(rank), backend=counter, fullgraph=True)(x).sum().backward()
        frames.append(counter.frame_count)
    return frames
