"""Functions the tests run on every rank of a real job (rtp_compile.launch, gloo)."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from decoders import build_decoder, decoder_batch
from torch.nn.parallel import DistributedDataParallel as DDP
from zoo import batch, build

import rtp_compile


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor): relative error, with a floor for tensors that are zero
    in exact arithmetic (a conv bias before BatchNorm, a key bias) and so hold rounding noise."""
    if not b.numel():
        return 0.0
    scale = max(b.abs().max().item(), floor)
    diff = (a - b).abs().max().item()
    return diff / scale if scale else diff


LR = 1e-2
F32_AFTER_ADAMW = 1e-3  # float32 after AdamW steps, whose update amplifies rounding


def param_errors(
    state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], names
) -> float:
    """Largest relative error over parameters after optimizer steps, each floored at the
    learning rate: Adam moves an element by up to lr per step whatever its gradient, so a
    parameter that stays ~0 in exact arithmetic (a zero-initialised key bias, whose gradient is
    rounding noise) is compared at that scale."""
    return max(rel_err(state[n], reference[n], LR) for n in names)


def grad_errors(full: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest relative error over all gradients, each floored at 1e-6 x the largest gradient."""
    floor = 1e-6 * max(g.abs().max().item() for g in reference.values() if g.numel())
    return max(rel_err(full[n], reference[n], floor) for n in full)


def loss_of(out: torch.Tensor, seed: int) -> torch.Tensor:
    """A loss that weighs every output element differently (so every gradient matters)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return (out * weights).sum() + 0.1 * out.pow(2).sum()


def gathered_grads(prog, gm, group=None) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, from the shards' .grad of all ranks of `group`."""
    out = {}
    for name, layout in prog.plan.params.items():
        g = gm.get_parameter(name).grad
        g = torch.zeros(layout.shard_shape, dtype=layout.dtype) if g is None else g
        shards = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, g.contiguous(), group=group)
        out[name] = layout.unshard(shards)
    return out


def train_next_to_ddp(prog, gm, model, batches, seed: int, call, output, ring=None) -> dict:
    """Train the rank module and a DDP replica of `model` side by side on `batches` with AdamW;
    max relative errors of the first output (vs the unsharded model), the first gradients and
    the parameters after every step (vs DDP over the whole job). `call(module, batch)` runs a
    module on a batch, `output(result)` picks the tensor the loss is taken on; `ring`: the
    rank module's process group (default: the whole job)."""
    for pname, layout in prog.plan.params.items():  # no parameter is a full replica
        assert tuple(gm.get_parameter(pname).shape) == layout.shard_shape, pname
    reference = copy.deepcopy(model)
    ddp = DDP(copy.deepcopy(model))
    # eps=1e-6: gradients that are zero in exact arithmetic (attention's key bias) are rounding
    # noise in both runs, and Adam's g/(|g|+eps) would amplify it to ~1e-9 with the default eps;
    # the gradients themselves are compared directly.
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1, eps=1e-6)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1, eps=1e-6)
    errors = {"output": 0.0, "grad": 0.0, "param": 0.0}
    losses = []  # an ordinary loop keeps its losses (and their graphs) for logging
    for step, inputs in enumerate(batches):
        out = call(gm, inputs)
        if step == 0:
            errors["output"] = rel_err(output(out), output(call(reference, inputs)))
        losses.append(loss_of(output(out), seed + step))
        losses[-1].backward()
        loss_of(output(call(ddp, inputs)), seed + step).backward()
        if step == 0:
            errors["grad"] = grad_errors(
                gathered_grads(prog, gm, ring),
                {n: ddp.module.get_parameter(n).grad for n in prog.plan.params},
            )
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
        errors["param"] = max(
            errors["param"],
            param_errors(prog.full_state_dict(gm), ddp.module.state_dict(), parameter_keys(model)),
        )
    return errors


def parameter_keys(model) -> list[str]:
    """The model's state_dict keys that are not buffers (its parameters, under the keys its
    state-dict hooks give them)."""
    buffers = {n for n, _ in model.named_buffers()}
    return [k for k in model.state_dict() if k not in buffers]


def random_model_parity(rank: int, world_size: int, spec: dict, seed: int) -> dict:
    """A random model of tests/random_models.py: train_next_to_ddp's errors over 2 AdamW
    steps, whether full_state_dict speaks the model's keys, and the plan's report."""
    from random_models import build_random, random_batch

    model = build_random(spec, seed)
    batches = [random_batch(spec, seed, rank, step) for step in range(2)]
    prog = rtp_compile.transform(
        model, world_size, example_inputs=(batches[0],) if spec["capture"] == "export" else None
    )
    gm = prog.module(rank)
    errors = train_next_to_ddp(prog, gm, model, batches, seed, lambda m, x: m(x), lambda o: o)
    return {
        **errors,
        "keys": list(prog.full_state_dict(gm)) == list(model.state_dict()),
        "report": prog.report(),
    }


def parity(
    rank: int,
    world_size: int,
    names: list[str],
    seed: int,
    steps: int = 3,
    captures=("fx", "export"),
) -> dict:
    """Per model of tests/zoo.py and capture path: train_next_to_ddp's errors."""
    results = {}
    for name in names:
        for capture in captures:
            model = build(name, seed)
            example = (batch(name, seed, rank, 0),) if capture == "export" else None
            # fuse_padding=1.0: attention with head groups N does not divide is fused too, so
            # the padded whole-group path is held to parity (the default would not fuse it)
            prog = rtp_compile.transform(
                model, world_size, example_inputs=example, fuse_padding=1.0
            )
            batches = [batch(name, seed, rank, step) for step in range(steps)]
            results[(name, capture)] = train_next_to_ddp(
                prog, prog.module(rank), model, batches, seed, lambda m, x: m(x), lambda o: o
            )
    return results


class ShardBufferTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """Watches every tensor any op creates: how many ring buffers (a flat message: one shard of
    each parameter of a unit) are alive at once, by storage, besides the rank's own shards and
    the gradients already produced; how many were ever allocated; and whether any tensor of a
    weight's full size ever appears."""

    def __init__(self, message_bytes: set[int], full: dict[str, int], params: list):
        super().__init__()
        self.message_bytes = message_bytes  # bytes of one flat message, per unit
        self.full = full  # weight -> bytes of the full weight
        self.params = params
        self.owned = {p.untyped_storage().data_ptr() for p in params}
        self.alive: dict[int, object] = {}
        self.peak = self.created = self.peak_bytes = 0
        self.full_size: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            for name, full_bytes in self.full.items():
                if storage.nbytes() == full_bytes or t.numel() * t.element_size() == full_bytes:
                    self.full_size.append(f"{func} made a {tuple(t.shape)} tensor ({name} size)")
            key = storage.data_ptr()
            if (
                storage.nbytes() in self.message_bytes
                and key not in self.owned
                and (key not in self.alive or self.alive[key]() is None)
            ):
                self.alive[key] = weakref.ref(storage)
                self.created += 1
        live = self.live()
        self.peak = max(self.peak, len(live))
        self.peak_bytes = max(self.peak_bytes, sum(self.alive[k]().nbytes() for k in live))
        return out

    def live(self) -> set[int]:
        """Message buffers alive now, gradients already produced left out."""
        grads = {p.grad.untyped_storage().data_ptr() for p in self.params if p.grad is not None}
        return {k for k, r in self.alive.items() if r() is not None and k not in grads}

    def reset(self):
        self.peak = self.created = self.peak_bytes = 0


def buffer_peaks(rank: int, world_size: int, seed: int) -> dict:
    """Peak number of live ring buffers, and how many were allocated, forward and backward,
    for a model whose sizes are unique (no activation shares a unit's or a weight's byte
    size)."""
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 19), nn.Tanh(), nn.Linear(19, 3)
    ).double()
    prog = rtp_compile.transform(model, world_size, bucket_bytes=0)  # units' own messages
    gm = prog.module(rank)
    messages = {
        sum(prog.plan.params[p].shard_bytes for p in u.params.values()) for u in prog.plan.units
    }
    full = {
        name: math.prod(lay.shape) * 8
        for name, lay in prog.plan.params.items()
        if name.endswith("weight")
    }
    x = torch.randn(9, 24, dtype=torch.float64, requires_grad=True)  # no activation of those sizes
    with ShardBufferTracker(messages, full, list(gm.parameters())) as tracker:
        loss = gm(x).pow(2).sum()
        forward = {"peak": tracker.peak, "created": tracker.created}
        forward_bytes = tracker.peak_bytes
        tracker.reset()
        loss.backward()
        backward = {"peak": tracker.peak, "created": tracker.created}
    del loss
    from rtp_compile.runtime import packing, ring

    return {
        "forward": forward,
        "backward": backward,
        "full_size": tracker.full_size,
        "forward_bytes": forward_bytes,
        "largest_message": max(messages),
        "leftover": len(tracker.live()),
        "pending": len(ring._pending),
        "pooled": len(packing.pool.buffers),
        "units": len(prog.plan.units),
        "kinds": sorted(u.kind for u in prog.plan.units),
    }


class SizeTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """How many tensors of one byte size (storages, not views) any op created that are alive
    at once, at most."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes, self.alive, self.peak = nbytes, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() == self.nbytes:
                self.alive[t.untyped_storage().data_ptr()] = weakref.ref(t.untyped_storage())
        self.alive = {k: r for k, r in self.alive.items() if r() is not None}
        self.peak = max(self.peak, len(self.alive))
        return out


def summed_output_peak(rank: int, world_size: int, seed: int) -> dict:
    """Logits-sized tensors alive at once in the forward of a GPT whose head is tied to its
    embedding (a row split: every step's part is the size of the whole logits), and the
    logits' error against the unsharded model."""
    from rtp_compile.apps.models import GPTConfig, TinyGPT

    torch.manual_seed(seed)
    model = TinyGPT(
        GPTConfig(vocab_size=211, block_size=8, n_layer=1, n_head=2, n_embd=16)
    ).double()
    prog = rtp_compile.transform(model, world_size)
    gm = prog.module(rank)
    idx = torch.randint(0, 211, (3, 8), generator=torch.Generator().manual_seed(seed + rank))
    with SizeTracker(3 * 8 * 211 * 8) as tracker:  # the logits' bytes; nothing else has them
        out = gm(idx)
    return {"peak": tracker.peak, "head": prog.plan.units[-1].mode, "out": rel_err(out, model(idx))}


def no_grad_then_train(rank: int, world_size: int, seed: int, bucket_bytes: int = 0) -> dict:
    """Forward under no_grad and in eval mode leaves every parameter exactly as it was, and the
    next training step still matches DDP."""
    model = build("gpt", seed)
    prog = rtp_compile.transform(model, world_size, bucket_bytes=bucket_bytes)
    gm = prog.module(rank)
    before = {n: p.detach().clone() for n, p in gm.named_parameters()}
    x = batch("gpt", seed, rank, 0)
    with torch.no_grad():
        out_no_grad = gm(x)
    gm.eval()
    out_eval = gm(x)
    gm.train()
    unchanged = all(torch.equal(before[n], p) for n, p in gm.named_parameters())
    ddp = DDP(copy.deepcopy(model))
    loss_of(gm(x), seed).backward()
    loss_of(ddp(x), seed).backward()
    grad = grad_errors(
        gathered_grads(prog, gm), {n: ddp.module.get_parameter(n).grad for n in prog.plan.params}
    )
    reference = model(x)
    return {
        "unchanged": unchanged,
        "grad": grad,
        "no_grad_out": rel_err(out_no_grad, reference),
        "eval_out": rel_err(out_eval, reference),
        "no_grad_fn": out_no_grad.grad_fn is None,
    }


def accumulate_like_ddp(
    rank: int, world_size: int, seed: int, reduction: str, bucket_bytes: int = 0
) -> dict:
    """Two forward/backward passes before one step, the first loss still alive (an ordinary
    loop keeping last step's loss for logging): gradients accumulate like DDP's."""
    model = build("mlp", seed)
    prog = rtp_compile.transform(
        model, world_size, grad_reduction=reduction, bucket_bytes=bucket_bytes
    )
    gm = prog.module(rank)
    ddp = DDP(copy.deepcopy(model))
    kept = []
    for step in range(2):
        x = batch("mlp", seed, rank, step)
        loss = loss_of(gm(x), seed + step)
        loss.backward(retain_graph=True)
        kept.append(loss)  # the graph of the previous step stays alive
        loss_of(ddp(x), seed + step).backward()
    scale = world_size if reduction == "sum" else 1
    return {
        "grad": grad_errors(
            gathered_grads(prog, gm),
            {n: ddp.module.get_parameter(n).grad * scale for n in prog.plan.params},
        )
    }


def state_dict_roundtrip(rank: int, world_size: int, seed: int, path: str) -> dict:
    """full_state_dict gives the model's keys and shapes (tied aliases too, buffers too, keys a
    module renames with state-dict hooks as it renames them); load_full_state_dict and
    module(checkpoint=) put another model's state into the shards exactly. Per model: gpt (tied
    head), neox (a packed qkv saved as wq / wk / wv)."""
    import pickle

    out = {}
    for name, build_model, make_batch in [
        ("gpt", lambda s: build("gpt", s), lambda: batch("gpt", seed, rank, 0)),
        ("neox", lambda s: build_decoder("neox", s), lambda: decoder_batch(seed, rank)),
    ]:
        model, other = build_model(seed), build_model(seed + 1)
        x = make_batch()
        prog = rtp_compile.transform(
            model, world_size, example_inputs=(x,) if name == "neox" else None
        )
        gm = prog.module(rank)
        full = prog.full_state_dict(gm)
        expected = model.state_dict()
        same_keys = list(full) == list(expected)
        exact = all(torch.equal(full[k], expected[k]) for k in expected)
        prog.load_full_state_dict(gm, other.state_dict())
        loaded = prog.full_state_dict(gm)
        if rank == 0:
            torch.save(other.state_dict(), f"{path}.{name}")
        dist.barrier()
        from_file = prog.module(rank, checkpoint=f"{path}.{name}")
        copies = [copy.deepcopy(gm)]  # e.g. an EMA copy
        if name == "gpt":  # torch.save (an exported graph's guard module does not pickle)
            copies.append(pickle.loads(pickle.dumps(gm)))
        out[name] = {
            "same_keys": same_keys,
            "exact": exact,
            "loaded": all(torch.equal(loaded[k], v) for k, v in other.state_dict().items()),
            "output": max(rel_err(m(x), other(x)) for m in [gm, from_file]),
            "copies": max(rel_err(c(x), other(x)) for c in copies),
            "copies_state": all(
                torch.equal(prog.full_state_dict(c)[k], v)
                for c in copies
                for k, v in other.state_dict().items()
            ),
        }
    return out


def subgroup_programs(rank: int, world_size: int, seed: int) -> dict:
    """Two RTP groups of 2 ranks in a job of 4: each program communicates only in its group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    model = build("mlp", seed + rank // 2)  # each group trains its own model
    prog = rtp_compile.transform(model, 2)
    gm = prog.module(dist.get_rank(group), group=group)
    x = batch("mlp", seed, rank, 0)
    loss_of(gm(x), seed).backward()
    ddp = DDP(copy.deepcopy(model), process_group=group)
    loss_of(ddp(x), seed).backward()
    grads = gathered_grads(prog, gm, group)
    return {
        "output": rel_err(gm(x), model(x)),
        "grad": grad_errors(grads, {n: ddp.module.get_parameter(n).grad for n in grads}),
    }


def run_program_of(rank: int, world_size: int, program_world_size: int, module_rank) -> None:
    """Run a program compiled for `program_world_size` as the module of `module_rank(rank)`."""
    prog = rtp_compile.transform(build("mlp", 0), program_world_size)
    gm = prog.module(module_rank(rank))
    gm(batch("mlp", 0, rank, 0))


def stall_one_rank(rank: int, world_size: int) -> None:
    """Rank 1 stays alive but never joins the ring: rank 0 must fail by the timeout of the
    group the module runs on (5 s; the job's own is long, so a slow start does not matter)."""
    import datetime
    import time

    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=5))
    prog = rtp_compile.transform(build("mlp", 0), world_size)
    gm = prog.module(rank, group=group)
    if rank == 1:
        time.sleep(60)
    gm(batch("mlp", 0, rank, 0))


def hf_parity(rank: int, world_size: int, names: list[str], seed: int, steps: int = 3) -> dict:
    """parity() for transformers models and nn.TransformerEncoder, compiled as a new user
    would: `transform(model, N)` with no example inputs where the model offers dummy_inputs.
    Also reports the output type, so ModelOutputs are seen to come back as such."""
    from hf_zoo import HF_ZOO, build_hf, hf_batch, logits_of

    results = {}
    for name in names:
        model = build_hf(name, seed)
        batches = [hf_batch(name, seed, rank, step) for step in range(steps)]
        prog = rtp_compile.transform(
            model, world_size, example_kwargs=batches[0] if HF_ZOO[name][3] else None
        )
        gm = prog.module(rank)
        named = dict(gm.named_parameters(remove_duplicate=False))  # exactly the shards
        results[(name, "parameters")] = (
            sorted(named) == sorted(prog.plan.params)
            and len(named) == len(list(model.parameters()))
            and not any(p.is_meta for p in named.values())
        )
        results[(name, "type")] = (
            type(gm(**batches[0])).__name__,
            type(model(**batches[0])).__name__,
        )
        results[name] = train_next_to_ddp(
            prog, gm, model, batches, seed, lambda m, inputs: m(**inputs), logits_of
        )
        results[(name, "report")] = prog.report()
    return results


def travelled_program_parity(rank: int, world_size: int, prog, model, name: str, seed: int) -> dict:
    """hf_parity() for a program compiled by the parent and passed to `launch` with its model
    (README's local pattern); also what the program is here (plan, code)."""
    from hf_zoo import hf_batch, logits_of

    batches = [hf_batch(name, seed, rank, step) for step in range(2)]
    gm = prog.module(rank)
    errors = train_next_to_ddp(
        prog, gm, model, batches, seed, lambda m, inputs: m(**inputs), logits_of
    )
    return {
        "errors": errors,
        "plan": str(prog.plan),
        "code": prog.graph_module.code,
        "same_model": prog.ctx.model is model,
    }


def buffers_like_ddp(
    rank: int, world_size: int, seed: int, broadcast: bool, mesh_shape=None
) -> dict:
    """BatchNorm running statistics after two training steps, against DDP with the same
    broadcast_buffers setting (and the output of an eval-mode forward). `mesh_shape`: the rank
    module is `prog.module(mesh=...)` of a (replicas, ring) mesh of that shape."""
    from torch.distributed.device_mesh import init_device_mesh

    model = build("conv", seed)
    if mesh_shape is None:
        prog = rtp_compile.transform(model, world_size)
        gm = prog.module(rank, broadcast_buffers=broadcast)
    else:
        prog = rtp_compile.transform(model, mesh_shape[-1])
        gm = prog.module(mesh=init_device_mesh("cpu", mesh_shape), broadcast_buffers=broadcast)
    ddp = DDP(copy.deepcopy(model), broadcast_buffers=broadcast)
    for step in range(2):
        x = batch("conv", seed, rank, step)
        loss_of(gm(x), seed).backward()
        loss_of(ddp(x), seed).backward()
    buffers = {n: rel_err(b, ddp.module.get_buffer(n)) for n, b in gm.named_buffers()}
    gm.eval(), ddp.eval()
    x = batch("conv", seed, rank, 9)
    return {
        "buffers": max(buffers.values()),
        "names": sorted(buffers),
        "eval_output": rel_err(gm(x), ddp(x)),
    }


def parity_without(rank: int, world_size: int, cases: list, seed: int, steps: int = 2) -> dict:
    """train_next_to_ddp's errors for programs compiled with one pass disabled: `cases` are
    (model name, capture, disabled pass)."""
    results = {}
    for name, capture, disabled in cases:
        model = build(name, seed)
        example = (batch(name, seed, rank, 0),) if capture == "export" else None
        prog = rtp_compile.transform(model, world_size, example_inputs=example, disable=[disabled])
        batches = [batch(name, seed, rank, step) for step in range(steps)]
        results[(name, capture, disabled)] = train_next_to_ddp(
            prog, prog.module(rank), model, batches, seed, lambda m, x: m(x), lambda o: o
        )
    return results


def decoder_parity(rank: int, world_size: int, cases: list, seed: int, steps: int = 2) -> dict:
    """Per (model, transform options): train_next_to_ddp's errors, the program's report and the
    kinds of the units that read each parameter. A decoder of tests/decoders.py is exported; a
    model of tests/zoo.py is captured by torch.fx."""
    from decoders import DECODERS, build_decoder, decoder_batch

    results = {}
    for name, options in cases:
        if name in DECODERS:
            model, example = build_decoder(name, seed), (decoder_batch(seed, 0),)
            batches = [decoder_batch(seed, rank, step) for step in range(steps)]
        else:
            model, example = build(name, seed), None
            batches = [batch(name, seed, rank, step) for step in range(steps)]
        prog = rtp_compile.transform(model, world_size, example_inputs=example, **options)
        key = (name, tuple(sorted(options.items())))
        results[key] = train_next_to_ddp(
            prog, prog.module(rank), model, batches, seed, lambda m, x: m(x), lambda o: o
        )
        results[key + ("report",)] = prog.report()
        results[key + ("kinds",)] = {
            p: [u.kind for u in prog.plan.units_of(p)] for p in prog.plan.params
        }
    return results


def across_a_recreated_group(rank: int, world_size: int, port: int, seed: int) -> dict:
    """A module trained, the job's process group destroyed and created again (another store,
    another timeout), the same module trained again: the ring finds the new group's peers."""
    import datetime

    from rtp_compile.runtime import groups

    prog = rtp_compile.transform(build("gpt", seed), world_size)
    gm = prog.module(rank)
    x = batch("gpt", seed, rank, 0)
    grads = []
    for round_ in range(2):
        gm.zero_grad()
        loss_of(gm(x), seed).backward()
        grads.append({n: p.grad.clone() for n, p in gm.named_parameters()})
        if round_ == 0:
            dist.destroy_process_group()
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=77),
            )
    return {
        "same_grads": all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0]),
        "timeout_s": groups.peers("", 1).timeout.total_seconds(),
        "world": groups.peers("", 1).group is dist.group.WORLD,
    }


def tensor_parallel_matches(rank: int, world_size: int, seed: int) -> float:
    """The benchmark's tensor-parallel TinyGPT against the unsharded one on one batch: the
    largest relative error of the logits."""
    from torch.distributed.device_mesh import init_device_mesh

    from rtp_compile.apps.bench_speed import PRESETS, head_parallel
    from rtp_compile.apps.models import TinyGPT

    config = PRESETS["tiny"][0]
    torch.manual_seed(seed)
    model = TinyGPT(config)
    tp = head_parallel(copy.deepcopy(model), init_device_mesh("cpu", (world_size,)))
    idx = torch.randint(
        0, config.vocab_size, (2, config.block_size), generator=torch.Generator().manual_seed(seed)
    )
    return rel_err(tp(idx), model(idx))


def bucket_parity(rank: int, world_size: int, cases: list, seed: int, steps: int = 2) -> dict:
    """Per (model, bucket_bytes): its buckets, train_next_to_ddp's errors, and the ring messages
    one training step sends."""
    from rtp_compile.runtime import ring

    results = {}
    for name, bucket_bytes in cases:
        model = build(name, seed)
        prog = rtp_compile.transform(model, world_size, bucket_bytes=bucket_bytes)
        gm = prog.module(rank)
        batches = [batch(name, seed, rank, step) for step in range(steps)]
        errors = train_next_to_ddp(prog, gm, model, batches, seed, lambda m, x: m(x), lambda o: o)
        hops = ring.traffic["hops"]
        loss_of(gm(batches[0]), seed).backward()
        results[(name, bucket_bytes)] = {
            "buckets": prog.ctx.buckets,
            "errors": errors,
            "messages": ring.traffic["hops"] - hops,
        }
    return results


def two_forwards_then_backward(rank: int, world_size: int, seed: int) -> dict:
    """Two forwards of a bucketed program, then one backward of both losses (microbatches
    summed before backward): each forward keeps its own bucket state; gradients as DDP's."""
    model = build("gpt", seed)
    prog = rtp_compile.transform(model, world_size, bucket_bytes=1 << 40)
    gm = prog.module(rank)
    ddp = DDP(copy.deepcopy(model))
    xs = [batch("gpt", seed, rank, step) for step in range(2)]
    (loss_of(gm(xs[0]), seed) + loss_of(gm(xs[1]), seed + 1)).backward()
    (loss_of(ddp(xs[0]), seed) + loss_of(ddp(xs[1]), seed + 1)).backward()
    return {
        "buckets": len(prog.ctx.buckets),
        "grad": grad_errors(
            gathered_grads(prog, gm),
            {n: ddp.module.get_parameter(n).grad for n in prog.plan.params},
        ),
    }


def bucket_buffers(rank: int, world_size: int, seed: int) -> dict:
    """Ring buffers alive forward and backward (measured, as buffer_peaks) for a model whose
    units form one bucket: forward holds the bucket gathered, backward its weights and its
    gradient rows.
    The model's units: a fused block and a rotated linear."""
    from torch import nn

    from rtp_compile.runtime import packing, ring

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 19), nn.Tanh(), nn.Linear(19, 3)
    ).double()
    message = sum(math.prod(p.shape) * 8 for p in model.parameters())  # N shards: padding
    budget = 2 * message
    prog = rtp_compile.transform(model, world_size, bucket_bytes=budget)
    gm = prog.module(rank)
    (members,) = prog.ctx.buckets.values()
    bucket = sum(
        prog.plan.params[p].shard_bytes for u in prog.plan.units for p in u.params.values()
    )
    full = {
        name: math.prod(lay.shape) * 8
        for name, lay in prog.plan.params.items()
        if name.endswith("weight")
    }
    x = torch.randn(9, 24, dtype=torch.float64, requires_grad=True)
    with ShardBufferTracker({bucket}, full, list(gm.parameters())) as tracker:
        loss = gm(x).pow(2).sum()
        forward = tracker.peak_bytes
        tracker.reset()
        loss.backward()
        backward = tracker.peak
    del loss
    return {
        "units": (len(members), len(prog.plan.units)),
        "message": bucket,
        "budget": budget,
        "forward_bytes": forward,
        "backward": backward,
        "leftover": len(tracker.live()),
        "pending": len(ring._pending),
        "pooled": len(packing.pool.buffers),
    }


def trained_state(rank: int, world_size: int, names: list[str], seed: int, steps: int = 3) -> dict:
    """For each RTP world size k = 1..world_size, on the first k ranks (a group of them): each
    model of `names` compiled and trained `steps` AdamW steps from the seed; its full
    state_dict, this rank's shards and their gradients, for comparing runs."""
    out = {}
    for k in range(1, world_size + 1):
        group = dist.new_group(list(range(k)))  # every rank takes part in making it
        if rank >= k:
            continue
        for name in names:
            prog = rtp_compile.transform(build(name, seed), k)
            gm = prog.module(rank, group=group)
            opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1)
            for step in range(steps):
                loss_of(gm(batch(name, seed, rank, step)), seed + step).backward()
                opt.step()
                if step < steps - 1:
                    opt.zero_grad()
            out[(k, name)] = {
                "full": prog.full_state_dict(gm),
                "shards": {n: p.detach().clone() for n, p in gm.named_parameters()},
                "grads": {
                    n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None
                },
            }
    return out


def die_mid_step(rank: int, world_size: int, where: str, report_dir: str) -> None:
    """Rank 1 dies (os._exit) in the middle of the forward or of the backward, at a unit's
    runtime; the other ranks write what they raised, and when, to `report_dir`, and re-raise."""
    import datetime
    import os
    import pathlib
    import time

    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=5))
    gm = rtp_compile.transform(build("gpt", 0), world_size, bucket_bytes=0).module(
        rank, group=group
    )
    units = [name for name, _ in gm.named_modules() if name.startswith("rtp_units.")]
    middle = gm.get_submodule(units[len(units) // 2])
    if rank == 1 and where == "forward":
        middle.register_forward_pre_hook(lambda *args: os._exit(3))
    if rank == 1 and where == "backward":
        middle.register_full_backward_pre_hook(lambda *args: os._exit(4))
    dist.barrier()
    start = time.monotonic()
    try:
        loss_of(gm(batch("gpt", 0, rank, 0)), 0).backward()
    except RuntimeError as err:
        (pathlib.Path(report_dir) / f"rank{rank}.txt").write_text(
            f"{time.monotonic() - start:.2f}\n{err}"
        )
        raise


def failed_forward_leaves_state(rank: int, world_size: int, seed: int) -> dict:
    """A forward that raises after its first unit (a batch longer than the position table, on
    every rank) between two AdamW steps, next to DDP: what it changed, what it left in flight,
    and the errors of the steps after it against DDP."""
    from rtp_compile.runtime import ring

    model = build("gpt", seed)
    prog = rtp_compile.transform(model, world_size)
    gm, ddp = prog.module(rank), DDP(copy.deepcopy(model))
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1)

    def step(module, optimizer, n):
        loss_of(module(batch("gpt", seed, rank, n)), seed + n).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(gm, opt, 0), step(ddp, ddp_opt, 0)
    before = (
        {n: p.detach().clone() for n, p in gm.named_parameters()},
        {n: p.grad for n, p in gm.named_parameters()},
        copy.deepcopy(opt.state_dict()),
    )
    too_long = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(seed))
    try:
        gm(too_long)
        raised = None
    except Exception as err:  # noqa: BLE001 - whatever the user's model raises
        raised = f"{type(err).__name__}: {err}"
    after = (
        {n: p.detach().clone() for n, p in gm.named_parameters()},
        {n: p.grad for n, p in gm.named_parameters()},
        opt.state_dict(),
    )
    unchanged = (
        all(torch.equal(before[0][n], after[0][n]) for n in before[0])
        and all(after[1][n] is None for n in after[1])
        and all(
            torch.equal(a, b)
            for n in before[2]["state"]
            for k in before[2]["state"][n]
            for a, b in [(before[2]["state"][n][k], after[2]["state"][n][k])]
        )
    )
    left = len(ring._pending)
    for n in (1, 2):
        step(gm, opt, n), step(ddp, ddp_opt, n)
    return {
        "raised": raised,
        "unchanged": unchanged,
        "left_in_flight": left,
        "param": param_errors(
            prog.full_state_dict(gm),
            ddp.module.state_dict(),
            [n for n, _ in model.named_parameters()],
        ),
    }


def failed_backward_leaves_state(
    rank: int, world_size: int, seed: int, where: str, mesh_shape=None
) -> dict:
    """A backward that raises half-way on every rank, after one accumulated backward (so the
    shards' .grad hold values to keep), next to DDP: `where` = "user" (the model's own op raises
    after the units behind it finished; rolled back by the next forward) or "unit" (a unit's
    backward raises, as a failed hop does; rolled back at once). The state right after the
    failure ("unit") or after the next forward ("user"), hops left in flight, and the errors of
    the steps after it against DDP (which never saw the failed backward). `mesh_shape`: the rank
    module is `prog.module(mesh=...)` of a (replicas, ring) mesh of that shape."""
    from torch.distributed.device_mesh import init_device_mesh
    from zoo import FailingBackward

    from rtp_compile.runtime import ring
    from rtp_compile.runtime.rotated import RotatedOpRuntime

    model = build("midfail", seed)
    if mesh_shape is None:
        prog = rtp_compile.transform(model, world_size)
        gm = prog.module(rank)
    else:
        prog = rtp_compile.transform(model, mesh_shape[-1])
        gm = prog.module(mesh=init_device_mesh("cpu", mesh_shape))
    ddp = DDP(copy.deepcopy(model))
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1)

    def backward(module, n):
        loss_of(module(batch("midfail", seed, rank, n)), seed + n).backward()

    for module, optimizer in ((gm, opt), (ddp, ddp_opt)):
        backward(module, 0)
        optimizer.step()
        optimizer.zero_grad()
        backward(module, 1)  # accumulated: .grad holds batch 1's gradients
    before = (
        {n: p.detach().clone() for n, p in gm.named_parameters()},
        {n: p.grad.clone() for n, p in gm.named_parameters()},
        copy.deepcopy(opt.state_dict()),
    )
    original = RotatedOpRuntime.step_weight_grads
    if where == "user":
        FailingBackward.armed = True
    else:

        def failing(self, *args):
            if self.unit_name == "fc2":
                raise RuntimeError("a unit's backward failed")
            return original(self, *args)

        RotatedOpRuntime.step_weight_grads = failing
    try:
        backward(gm, 2)
        raised = None
    except Exception as err:  # noqa: BLE001 - whatever the backward raises
        raised = f"{type(err).__name__}: {err}"
    finally:
        FailingBackward.armed = False
        RotatedOpRuntime.step_weight_grads = original
    if where == "user":
        with torch.no_grad():
            gm(batch("midfail", seed, rank, 2))  # the next forward rolls the failed one back
    after = (
        {n: p.detach() for n, p in gm.named_parameters()},
        {n: p.grad for n, p in gm.named_parameters()},
        opt.state_dict(),
    )
    unchanged = (
        all(torch.equal(before[0][n], after[0][n]) for n in before[0])
        and all(
            after[1][n] is not None and torch.equal(before[1][n], after[1][n]) for n in before[1]
        )
        and all(
            torch.equal(a, b)
            for n in before[2]["state"]
            for k in before[2]["state"][n]
            for a, b in [(before[2]["state"][n][k], after[2]["state"][n][k])]
        )
    )
    left = len(ring._pending)
    for module, optimizer in ((gm, opt), (ddp, ddp_opt)):
        backward(module, 3)  # accumulates onto batch 1's gradients
        optimizer.step()
        optimizer.zero_grad()
        backward(module, 4)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "raised": raised,
        "unchanged": unchanged,
        "left_in_flight": left,
        "param": param_errors(
            prog.full_state_dict(gm), ddp.module.state_dict(), parameter_keys(model)
        ),
    }


def clip_like_ddp(rank: int, world_size: int, seed: int) -> dict:
    """rtp_compile.clip_grad_norm_ next to DDP's torch.nn.utils.clip_grad_norm_ on the GPT of
    tests/zoo.py (tied head, small parameters gathered, padded shards), per norm type, from
    the same gradients each time (max_norm a third of DDP's norm, so it clips): the totals'
    and the clipped gradients' relative errors, with the shards' padding gradients set to
    garbage first (they must not count); how far the local norm torch's own function gives on
    the shards is from the global one; and whether a nan gradient on rank 0 alone makes every
    rank raise with error_if_nonfinite=True."""
    model = build("gpt", seed)
    prog = rtp_compile.transform(model, world_size)
    gm, ddp = prog.module(rank), DDP(copy.deepcopy(model))
    x = batch("gpt", seed, rank)
    loss_of(gm(x), seed).backward()
    loss_of(ddp(x), seed).backward()
    shard_grads = [p.grad.clone() for p in gm.parameters()]  # padding entries zero
    padded = 0
    with torch.no_grad():
        for name, layout in prog.plan.params.items():
            slot, grad = layout.slot(rank), gm.get_parameter(name).grad
            if slot.valid < slot.length:
                flat = grad.reshape(-1) if layout.dim is None else grad
                flat.narrow(layout.dim or 0, slot.valid, slot.length - slot.valid).fill_(1e3)
                padded += 1
    grads = {p: p.grad.clone() for p in (*gm.parameters(), *ddp.parameters())}
    out = {"padded": padded}
    for norm_type in (2.0, math.inf, 1.0):
        for p, g in grads.items():
            p.grad.copy_(g)
        reference = torch.nn.utils.get_total_norm([p.grad for p in ddp.parameters()], norm_type)
        max_norm = reference.item() / 3
        total = rtp_compile.clip_grad_norm_(gm, max_norm, norm_type)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm, norm_type)
        local = torch.nn.utils.get_total_norm(shard_grads, norm_type)  # what torch's gives
        out[norm_type] = {
            "total": rel_err(total, reference),
            "grad": grad_errors(
                gathered_grads(prog, gm),
                {n: ddp.module.get_parameter(n).grad for n in prog.plan.params},
            ),
            "local_vs_global": rel_err(local, reference),
        }
    if rank == 0:
        next(gm.parameters()).grad.view(-1)[0] = math.nan
    try:
        rtp_compile.clip_grad_norm_(gm, 1.0, error_if_nonfinite=True)
        out["nonfinite"] = None
    except RuntimeError as err:
        out["nonfinite"] = str(err)
    return out


def micro_batches_like_ddp(rank: int, world_size: int, seed: int) -> dict:
    """Two AdamW steps of three micro-batches each, of different sizes (per micro-batch and
    rank), every loss divided by 3, next to DDP: the first step accumulates into gradients that
    are None, the second, after `zero_grad(set_to_none=False)`, into zero tensors. The
    accumulated gradients' and the parameters' largest relative errors."""
    model = build("gpt", seed)
    prog = rtp_compile.transform(model, world_size)
    gm, ddp = prog.module(rank), DDP(copy.deepcopy(model))
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1, eps=1e-6)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1, eps=1e-6)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    errors = {"grad": 0.0, "param": 0.0}
    for _ in range(2):
        for micro, size in enumerate((3, 1, 2)):
            idx = torch.randint(0, 37, (size + rank % 2, 8), generator=g)
            (loss_of(gm(idx), seed + micro) / 3).backward()
            (loss_of(ddp(idx), seed + micro) / 3).backward()
        errors["grad"] = max(
            errors["grad"],
            grad_errors(
                gathered_grads(prog, gm),
                {n: ddp.module.get_parameter(n).grad for n in prog.plan.params},
            ),
        )
        opt.step()
        ddp_opt.step()
        opt.zero_grad(set_to_none=False)
        ddp_opt.zero_grad(set_to_none=False)
        errors["param"] = max(
            errors["param"],
            param_errors(prog.full_state_dict(gm), ddp.module.state_dict(), parameter_keys(model)),
        )
    errors["grads_kept"] = all(p.grad is not None and not p.grad.any() for p in gm.parameters())
    return errors


def checkpointed_like_ddp(
    rank: int, world_size: int, seed: int, capture: str, bucket_bytes: int | None
) -> dict:
    """A model whose blocks run under torch.utils.checkpoint: train_next_to_ddp's errors over
    two AdamW steps (DDP runs the same checkpointed model) and the rank module's checkpointed
    regions; then, with and without the checkpoints, one forward and backward on a larger
    batch: its ring hops (the backward's include the recomputed forwards' hops: weights
    fetched again by rotation, never kept) and its peak bytes (MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from rtp_compile.runtime import packing, ring

    batches = [batch("checkpointed", seed, rank, step) for step in range(2)]
    large = torch.randn(
        64, 16, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + rank)
    )
    hops, peaks, errors, regions = {}, {}, {}, []
    for checkpointed in (True, False):
        model = build("checkpointed", seed)
        model.checkpointed = checkpointed
        prog = rtp_compile.transform(
            model,
            world_size,
            bucket_bytes=bucket_bytes,
            example_inputs=(batches[0],) if capture == "export" else None,
        )
        gm = prog.module(rank)
        if checkpointed:
            errors = train_next_to_ddp(
                prog, gm, model, batches, seed, lambda m, x: m(x), lambda o: o
            )
            regions = [
                name
                for name, _ in gm.named_modules()
                if name.startswith("rtp_checkpoints.") and name.count(".") == 1
            ]
        tracker = MemTracker()
        tracker.track_external(gm)
        with tracker:
            before = ring.traffic["hops"]
            loss = loss_of(gm(large), seed)
            forward = ring.traffic["hops"] - before
            loss.backward()
        hops[checkpointed] = (forward, ring.traffic["hops"] - before - forward)
        (peaks[checkpointed],) = tracker.get_tracker_snapshot("peak").values()
    return {
        **errors,
        "regions": regions,
        "hops": hops,
        "peak": {k: v["Total"] for k, v in peaks.items()},
        "left_in_flight": len(ring._pending),
        "pooled": len(packing.pool.buffers),
    }


def peer_raises_alone(
    rank: int, world_size: int, seed: int, where: str, compiled: bool = False
) -> dict:
    """Rank 1 alone raises in the second step (`where`: "forward", the model's own code after
    its first unit; "backward", a unit's backward; "loss", between forward and backward,
    outside the rank module; "leaves": as "forward", then it stops training and waits for the
    others to finish), on a ring group with a 3 s timeout. Every rank catches what its
    step raised and goes on until three steps have completed. Returns what each attempt raised,
    whether the failed step changed any parameter, gradient or optimizer state, the hops left
    in flight, and the parameters against the unsharded model trained with AdamW on the mean
    gradient of the batches each completed step used on each rank (exchanged over the healthy
    default group: a rank that failed twice pairs a later batch with its peers'). `compiled`:
    every unit outside a bucket and the module under `torch.compile` (aot_eager, fullgraph), so
    the peers' backwards that fail are traced ones (only `where="loss"`: the others patch the
    module's Python, which a compiled graph does not run again)."""
    import datetime
    import time

    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=3))
    model = build("gpt", seed)
    prog = rtp_compile.transform(model, world_size, **({"bucket_bytes": 0} if compiled else {}))
    gm = prog.module(rank, group=group)
    run = torch.compile(gm, backend="aot_eager", fullgraph=True) if compiled else gm
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1)
    from rtp_compile.runtime.rotated import RotatedOpRuntime

    units = [m for _, m in gm.named_modules() if isinstance(m, RotatedOpRuntime)]
    failing = units[len(units) // 2]
    armed = {"on": False}

    def own_code_raises(*args):
        if armed["on"] and where in ("forward", "leaves"):
            raise ValueError("rank 1's own code raised")

    step_weight_grads = type(failing).step_weight_grads

    def unit_raises(self, *args):
        if armed["on"] and where == "backward" and self is failing:
            raise RuntimeError("rank 1's unit backward raised")
        return step_weight_grads(self, *args)

    if not compiled:  # a compiled graph would guard on `armed` and recompile when it changes
        failing.register_forward_pre_hook(own_code_raises)
        type(failing).step_weight_grads = unit_raises
    snapshot = lambda: (
        {n: p.detach().clone() for n, p in gm.named_parameters()},  # noqa: E731
        {n: p.grad for n, p in gm.named_parameters()},
        copy.deepcopy(opt.state_dict()),
    )
    raised, used, unchanged, left = [], [], None, None
    attempt = 0
    dist.barrier()
    while len(used) < 3 and attempt < 6:
        before = snapshot() if attempt == 1 else None
        start = time.monotonic()
        armed["on"] = rank == 1 and attempt == 1
        try:
            out = run(batch("gpt", seed, rank, attempt))
            if armed["on"] and where == "loss":
                raise ValueError("rank 1's loss code raised")
            loss_of(out, seed + attempt).backward()
            opt.step()
            opt.zero_grad()
            used.append(attempt)
            raised.append(None)
        except Exception as err:  # noqa: BLE001 - what the step raised, on this rank
            raised.append(f"{type(err).__name__}: {err}")
            if isinstance(err, torch._dynamo.exc.Unsupported) and err.__context__ is not None:
                # torch 2.13: a compiled GraphModule whose graph raised is reported by dynamo
                # failing to trace fx's error handler, raised while handling the real error
                raised[-1] += f" (while handling {type(err.__context__).__name__}: "
                raised[-1] += f"{err.__context__})"
            if where == "leaves" and (rank == 1 or attempt == 2):  # rank 1 leaves the ring
                raised[-1] += f" (after {time.monotonic() - start:.1f} s)"
                attempt = 6
        if len(raised) == 2:
            after = snapshot()
            unchanged = (
                all(torch.equal(before[0][n], after[0][n]) for n in before[0])
                and all(after[1][n] is None for n in after[1])
                and all(
                    torch.equal(a, b)
                    for n in before[2]["state"]
                    for k in before[2]["state"][n]
                    for a, b in [(before[2]["state"][n][k], after[2]["state"][n][k])]
                )
            )
            left = len(rtp_compile.runtime.ring._pending)
        attempt += 1
    type(failing).step_weight_grads = step_weight_grads
    dist.barrier()  # over the default group
    if where == "leaves":
        return {"raised": raised, "used": used, "unchanged": unchanged, "left_in_flight": left}
    state = prog.full_state_dict(gm)
    every = [None] * world_size
    dist.all_gather_object(every, used)  # over the default group, not the ring's
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    for k in range(len(used)):
        loss = (
            sum(
                loss_of(reference(batch("gpt", seed, r, every[r][k])), seed + every[r][k])
                for r in range(world_size)
            )
            / world_size
        )
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {
        "raised": raised,
        "used": used,
        "unchanged": unchanged,
        "left_in_flight": left,
        "param": param_errors(state, reference.state_dict(), parameter_keys(model)),
    }
