"""The cells of the feature x family matrix (tests/matrix_spec.py), run on every rank of one
launch per world size. Each cell compares rtp_compile with an independent reference built in
the same job (DDP on the unsharded model; FSDP2 with the same mixed-precision policy; the
model's own state_dict; what a checkpoint saved) and returns its checks as
[what, value, op, bound]; a cell that raises is a failed cell and the launch goes on."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import os
import time
import traceback
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_zoo import build_hf, hf_batch, logits_of
from jobs import (
    F32_AFTER_ADAMW,
    LR,
    gathered_grads,
    grad_errors,
    loss_of,
    param_errors,
    parameter_keys,
    rel_err,
    train_next_to_ddp,
)
from matrix_spec import FAMILIES, MESH
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zoo import batch as zoo_batch
from zoo import build as zoo_build

import rtp_compile

F64, F32 = 1e-9, 1e-5
_ARGUMENT = {"gpt": "idx", "conv": "x"}  # the zoo models' forward argument


# --- a family: its model, batches and capture path -------------------------------------------


def build(family, seed: int, dtype=torch.float64) -> nn.Module:
    model = zoo_build(family.name, seed) if family.source == "zoo" else build_hf(family.name, seed)
    return model.to(dtype)


def make_batch(family, seed: int, rank: int, step: int, dtype=torch.float64) -> dict:
    """This rank's batch of `step`, as the keyword arguments of the model's forward."""
    inputs = (
        {_ARGUMENT[family.name]: zoo_batch(family.name, seed, rank, step)}
        if family.source == "zoo"
        else hf_batch(family.name, seed, rank, step)
    )
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def transform(family, model, world_size: int, example: dict, **options):
    """Through the family's capture path: fx without example inputs, export with them."""
    return rtp_compile.transform(
        model, world_size, **options, example_kwargs=example if family.path == "export" else None
    )


def call(module, inputs: dict) -> torch.Tensor:
    return logits_of(module(**inputs))


def tolerance(family, compiled: bool = False) -> float:
    """float64 to rounding; RMSNorm computed in float32 (HF Llama, Qwen2, Mixtral) to float32's,
    and under a compiler (`compiled`) a model with other parts in float32 too (T5's norm
    variance, GPT-NeoX's softmax: inductor's float32 kernels round them their own way)."""
    return F32 if family.float32_norms or (compiled and family.float32_parts) else F64


def _errors(errors: dict, tol: float) -> list:
    return [[f"{what} rel. error", err, "<=", tol] for what, err in errors.items()]


def _max_diff(got: dict, want: dict) -> float:
    return max(
        ((got[k].double() - want[k].double()).abs().max().item() if want[k].numel() else 0.0)
        for k in want
    )


# --- cells sharing one program per family (and world size) ------------------------------------


class Shared:
    """One transform of a float64 model that several cells use in turn; each cell starts by
    taking the rank module's current state into `model` (its reference's start)."""

    def __init__(self, family, rank: int, world_size: int, seed: int, workdir: str):
        self.family, self.rank, self.world_size, self.seed = family, rank, world_size, seed
        self.workdir = workdir
        self.model = build(family, seed)
        self.batches = [make_batch(family, seed, rank, step) for step in range(2)]
        self.prog = transform(family, self.model, world_size, self.batches[0])
        self.gm = self.prog.module(rank)

    def sync(self) -> None:
        self.model.load_state_dict(self.prog.full_state_dict(self.gm))
        self.gm.zero_grad(set_to_none=True)


def cell_full_state_dict(s: Shared) -> list:
    """prog.full_state_dict(gm) is the model's state_dict (keys in order, values exactly);
    load_full_state_dict of a perturbed one gives that back exactly. Runs first: `model` is
    still the one the program was made from."""
    full, expected = s.prog.full_state_dict(s.gm), s.model.state_dict()
    checks = [
        ["keys equal state_dict's, in order", list(full) == list(expected), "==", True],
        ["max |full - state_dict|", _max_diff(full, expected), "<=", 0.0],
    ]
    perturbed = {k: v + 0.5 if v.is_floating_point() else v for k, v in expected.items()}
    s.prog.load_full_state_dict(s.gm, perturbed)
    checks.append(
        ["max |loaded - perturbed|", _max_diff(s.prog.full_state_dict(s.gm), perturbed), "<=", 0.0]
    )
    s.prog.load_full_state_dict(s.gm, expected)
    return checks


def cell_plain(s: Shared) -> list:
    """Two AdamW steps next to DDP: the first output (vs the unsharded model), the first
    gradients and the parameters after each step (vs DDP)."""
    s.sync()
    return _errors(
        train_next_to_ddp(s.prog, s.gm, s.model, s.batches, s.seed, call, logits_of),
        tolerance(s.family),
    )


def _ddp_grads(prog, ddp) -> dict:
    return {n: ddp.module.get_parameter(n).grad for n in prog.plan.params}


def cell_clip(s: Shared) -> list:
    """rtp_compile.clip_grad_norm_ vs torch's on DDP, max_norm a third of DDP's norm (so it
    clips): the total norms and the clipped gradients."""
    s.sync()
    ddp = DDP(copy.deepcopy(s.model))
    for module in (s.gm, ddp):
        loss_of(call(module, s.batches[0]), s.seed).backward()
    reference = torch.nn.utils.get_total_norm([p.grad for p in ddp.parameters()])
    total = rtp_compile.clip_grad_norm_(s.gm, reference.item() / 3)
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), reference.item() / 3)
    errors = {
        "total norm": rel_err(total, reference),
        "clipped grad": grad_errors(gathered_grads(s.prog, s.gm), _ddp_grads(s.prog, ddp)),
    }
    s.gm.zero_grad(set_to_none=True)
    return _errors(errors, tolerance(s.family))


def cell_accumulation(s: Shared) -> list:
    """Two backward calls (micro-batches of 2 and 1 rows) before one AdamW step, next to DDP
    doing the same: the accumulated gradients and the parameters after the step."""
    s.sync()
    ddp = DDP(copy.deepcopy(s.model))
    opts = [
        torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1, eps=1e-6) for m in (s.gm, ddp)
    ]
    micro = [s.batches[0], {k: v[:1] for k, v in s.batches[1].items()}]
    for step, inputs in enumerate(micro):
        for module in (s.gm, ddp):
            loss_of(call(module, inputs), s.seed + step).backward()
    errors = {
        "accumulated grad": grad_errors(gathered_grads(s.prog, s.gm), _ddp_grads(s.prog, ddp))
    }
    for opt in opts:
        opt.step()
    errors["param after the step"] = param_errors(
        s.prog.full_state_dict(s.gm), ddp.module.state_dict(), parameter_keys(s.model)
    )
    s.gm.zero_grad(set_to_none=True)
    return _errors(errors, tolerance(s.family))


def cell_checkpoint(s: Shared) -> list:
    """N = 2: an AdamW step, rtp_compile.checkpoint.save, the parameters perturbed, load into a
    fresh optimizer. N = 3: load what the N = 2 launch saved (resharded). Either way the
    loaded full state and AdamW moments equal what the saving job had (its rank 0's: buffers
    are the first rank's, as with DDP) exactly, and `extra` is this rank's (rank 0's for a
    rank that did not save)."""
    from checkpoint_jobs import full_state_and_moments

    from rtp_compile.state import dcp as checkpoint

    path = os.path.join(s.workdir, "checkpoint", s.family.id)
    if s.world_size == 2:
        opt = torch.optim.AdamW(s.gm.parameters(), lr=LR, weight_decay=0.1)
        loss_of(call(s.gm, s.batches[0]), s.seed).backward()
        opt.step()
        opt.zero_grad()
        checkpoint.save(path, s.gm, opt, extra={"rank": s.rank})
        saved = full_state_and_moments(s.prog, s.gm, opt)
        if s.rank == 0:
            torch.save(saved, f"{path}.expected.pt")
        dist.barrier()
        with torch.no_grad():
            for p in s.gm.parameters():
                p.add_(1.0)
    elif not os.path.exists(f"{path}.expected.pt"):
        raise FileNotFoundError(f"{path}: the N = 2 launch saved no checkpoint to reshard")
    opt = torch.optim.AdamW(s.gm.parameters(), lr=LR, weight_decay=0.1)
    extra = checkpoint.load(path, s.gm, opt)
    expected = torch.load(f"{path}.expected.pt", weights_only=False)
    loaded = full_state_and_moments(s.prog, s.gm, opt)
    moments = max(
        max(
            (torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max().item()
            for a, b in zip(loaded["moments"][n], values)
        )
        for n, values in expected["moments"].items()
    )
    return [
        [
            "state keys equal the saved ones",
            list(loaded["state"]) == list(expected["state"]),
            "==",
            True,
        ],
        ["max |state - saved|", _max_diff(loaded["state"], expected["state"]), "<=", 0.0],
        ["max |AdamW moments, step - saved|", moments, "<=", 0.0],
        ["extra saved by rank", extra["rank"], "==", s.rank if s.rank < 2 else 0],
    ]


SHARED = {
    "full_state_dict": cell_full_state_dict,
    "plain": cell_plain,
    "clip": cell_clip,
    "accumulation": cell_accumulation,
    "checkpoint": cell_checkpoint,
}


# --- cells with a program of their own --------------------------------------------------------


@functools.cache
def _mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "rtp")[-len(shape) :])


def _ce_loss(out: torch.Tensor, seed: int) -> torch.Tensor:
    """Cross-entropy of the output's last dim against random labels: about ln(classes), so
    relative gaps between losses mean something."""
    flat = out.float().reshape(-1, out.shape[-1])
    labels = torch.randint(
        0, flat.shape[1], (flat.shape[0],), generator=torch.Generator().manual_seed(seed)
    )
    return F.cross_entropy(flat, labels)


def _losses(module, params, batches, seed: int) -> tuple[list[float], torch.dtype]:
    """AdamW steps: the losses, and the output's dtype (the compute dtype)."""
    opt = torch.optim.AdamW(params, lr=LR)
    losses = []
    for step, inputs in enumerate(batches):
        out = call(module, inputs)
        loss = _ce_loss(out, seed + step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, out.dtype


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def cell_mixed_precision(family, rank: int, world_size: int, seed: int) -> list:
    """float32 model, MixedPrecisionPolicy(bf16 params, fp32 reduce): the losses of 3 AdamW
    steps against FSDP2 (fully_shard) with the same policy, held to 4x FSDP2-bf16's own gap to
    FSDP2 in float32 (the largest over ranks; floor 2^-6); the output in FSDP2-bf16's
    dtype (computed in bfloat16); the shards stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batches = [make_batch(family, seed, rank, step, torch.float32) for step in range(3)]
    losses = {}
    for name, options in (("fp32", {}), ("bf16", {"mp_policy": policy})):
        model = build(family, seed, torch.float32)
        for module in model.modules():
            # FSDP2 cannot run BatchNorm with bfloat16 weights and float32 statistics ("expected
            # scalar type BFloat16 but found Float"): its usual setup keeps them in float32
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                fully_shard(module, mesh=_mesh((world_size,)))
        fsdp = fully_shard(model, mesh=_mesh((world_size,)), **options)
        losses[name] = _losses(fsdp, fsdp.parameters(), batches, seed)
    prog = transform(
        family, build(family, seed, torch.float32), world_size, batches[0], mp_policy=policy
    )
    gm = prog.module(rank)
    rtp, dtype = _losses(gm, gm.parameters(), batches, seed)
    (bf16, bf16_dtype), (fp32, _) = losses["bf16"], losses["fp32"]
    # bf16's noise: FSDP2-bf16's gap to float32 on the rank where it is largest (on one rank it
    # can be small by chance: ViT, seed 7, 7e-5 on rank 1 and 9.5e-4 on rank 0), at least
    # 2^-6. Both gaps are bf16 rounding that three AdamW steps amplify, so their ratio is
    # one noise sample over another: measured over 75 seeds (nn.TransformerEncoder at N = 2,
    # T5 at N = 3), RTP's gap to FSDP2-bf16 reached 6.4e-3 and FSDP2-bf16's own as little as
    # 4.9e-4; CI failed at 1.96e-3 under a floor of 2^-9, and at 5.0e-3 against 4 x 1.15e-3.
    # Losses see the forward: a missing cast is the dtype check's, and zeroing one parameter's
    # gradient moved the gap only by 1e-3 to 1e-2 (measured), within this bound.
    noise = torch.tensor(_gap(bf16, fp32))
    dist.all_reduce(noise, op=dist.ReduceOp.MAX)
    return [
        ["loss gap to FSDP2-bf16", _gap(rtp, bf16), "<=", max(4 * noise.item(), 2**-6)],
        ["output dtype", str(dtype), "==", str(bf16_dtype)],
        ["shards float32", {p.dtype for p in gm.parameters()} == {torch.float32}, "==", True],
    ]


class Checkpointed(nn.Module):
    """What a user writes to checkpoint the layers of a model they did not write: the block
    runs under torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False); other
    attributes are the block's (nn.TransformerEncoder reads its layers' settings)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "block":
                raise
            return getattr(self.block, name)


def checkpoint_layers(model: nn.Module) -> int:
    """Wrap every layer of the outermost nn.ModuleLists in Checkpointed (a model without one:
    each of its children that holds parameters); how many."""

    def wrap(module: nn.Module) -> int:
        count = 0
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                for i, layer in enumerate(child):
                    child[i] = Checkpointed(layer)
                count += len(child)
            else:
                count += wrap(child)
        return count

    count = wrap(model)
    if not count:
        for name, child in list(model.named_children()):
            if any(True for _ in child.parameters()):
                setattr(model, name, Checkpointed(child))
                count += 1
    return count


def _checkpointed_like_ddp(
    family, model, layers: int, rank: int, world_size: int, seed: int
) -> list:
    batches = [make_batch(family, seed, rank, step) for step in range(2)]
    prog = transform(family, model, world_size, batches[0])
    gm = prog.module(rank)
    regions = sum(
        1
        for name, _ in gm.named_modules()
        if name.startswith("rtp_checkpoints.") and name.count(".") == 1
    )
    return [
        [f"checkpointed regions in the rank program (of {layers} layers)", regions, "==", layers],
        *_errors(
            train_next_to_ddp(prog, gm, model, batches, seed, call, logits_of), tolerance(family)
        ),
    ]


def cell_ac_model(family, rank: int, world_size: int, seed: int) -> list:
    """transformers' own switch, non-reentrant; gradients and AdamW steps vs DDP of the same
    model; every layer it checkpoints is a checkpointed region of the rank program."""
    model = build(family, seed)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = sum(
        isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
        for m in model.modules()
    )
    return _checkpointed_like_ddp(family, model, layers, rank, world_size, seed)


def cell_ac_user(family, rank: int, world_size: int, seed: int) -> list:
    """The model's layers (every nn.ModuleList's; the whole model if it has none) each under
    torch.utils.checkpoint in user code (Checkpointed), without the KV cache a recomputation
    would extend twice (use_cache=False, as transformers' own switch sets it)."""
    model = build(family, seed)
    for module in model.modules():  # T5's decoder stack has a config of its own
        if hasattr(getattr(module, "config", None), "use_cache"):
            module.config.use_cache = False
    layers = checkpoint_layers(model)
    return _checkpointed_like_ddp(family, model, layers, rank, world_size, seed)


def cell_inductor(family, rank: int, world_size: int, seed: int) -> list:
    """float32: torch.compile(prog.module(rank), fullgraph=True) with inductor, one step: its
    output vs the unsharded model's and its gradients vs DDP's (1e-5); one frame compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = build(family, seed, torch.float32)
    inputs = make_batch(family, seed, rank, 0, torch.float32)
    prog = transform(family, model, world_size, inputs)
    gm = prog.module(rank)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(gm, backend=counter, fullgraph=True)
    ddp = DDP(copy.deepcopy(model))
    out = call(compiled, inputs)
    errors = {"output": rel_err(out, call(model, inputs))}
    loss_of(out, seed).backward()
    loss_of(call(ddp, inputs), seed).backward()
    grads, reference = gathered_grads(prog, gm), _ddp_grads(prog, ddp)
    # a gradient zero in exact arithmetic (a key bias, a conv bias before BatchNorm) is float32
    # rounding noise of the terms that cancel in it: measured between the eager rank module and
    # DDP (no inductor) up to 1.1e-7 of the model's largest gradient (ConvNet's conv1.bias;
    # ViT's key bias 1e-10 under inductor); so each gradient's error is relative to its own
    # largest element or to a tenth of the model's largest gradient, whichever is larger
    floor = 0.1 * max(g.abs().max().item() for g in reference.values())
    errors["grad"] = max(rel_err(grads[n], g, floor) for n, g in reference.items())
    torch._dynamo.reset()
    return [*_errors(errors, F32), ["frames compiled", counter.frame_count, "==", 1]]


@contextlib.contextmanager
def _shard_examples(family, example: dict):
    """rtp_compile.shard as the family's column captures: with example inputs on the export
    path (backend_jobs.train_compiled_next_to_ddp calls it with the model alone)."""
    shard = rtp_compile.shard
    if family.path == "export":
        rtp_compile.shard = functools.partial(shard, example_kwargs=example)
    try:
        yield
    finally:
        rtp_compile.shard = shard


def cell_backend(family, rank: int, world_size: int, seed: int, contract: str) -> list:
    """torch.compile(model, backend=rtp_compile.backend(world_size=N)), its defaults (the rank
    program compiled by inductor), contract (a) rtp_compile.shard first or (b) the optimizer
    first: backend_jobs.train_compiled_next_to_ddp's 3 AdamW steps vs DDP (and for (a) the
    sharded model run eagerly and clipped); then after one more backward, the bytes of the
    parameters and gradients alive that were not before the model was built, over the full
    parameters and gradients: between 0.8 / N and 1.25 / N, as tests/test_backend.py bounds it.
    (a): load_full_state_dict round trip."""
    from backend_jobs import train_compiled_next_to_ddp

    torch._dynamo.reset()
    before = _live_storages(parameters=True)
    model = build(family, seed)
    full = sum(2 * p.numel() * p.element_size() for p in model.parameters())

    def tokens(r, step_seed):
        return make_batch(family, step_seed, r, 0)

    with _shard_examples(family, tokens(rank, seed)):
        result, opt, compiled = train_compiled_next_to_ddp(
            model,
            lambda m, inputs: m(**inputs),
            logits_of,
            tokens,
            rank,
            seed,
            contract,
            backend=rtp_compile.backend(world_size=world_size),
        )
    loss_of(call(compiled, tokens(rank, seed)), seed).backward()
    held = (
        sum(
            t.untyped_storage().nbytes()
            for ptr, t in _live_storages(parameters=True).items()
            if ptr not in before
        )
        / full
    )
    graphs = result["graphs"]
    # backend_jobs' own "load" adds 0.5 to integer buffers too (BatchNorm's count)
    whats = ["output", "loss", "grad", "param"] + (
        ["eager", "eager_grad", "clip"] if contract == "a" else []
    )
    # in float32 the first output and gradients are held to float32's rounding; what follows
    # AdamW steps (later losses, the parameters, the eager run and clip after them) to what
    # AdamW's update makes of it
    tol = tolerance(family, compiled=True)
    first = ("output", "grad")
    checks = [
        *_errors({w: result[w] for w in whats if w in first}, tol),
        *_errors(
            {w: result[w] for w in whats if w not in first}, F32_AFTER_ADAMW if tol == F32 else tol
        ),
        ["every parameter has a shard (the backend ran)", result["sharded"], "==", True],
        [
            f"no recompile on equal shapes (graphs after each step: {graphs})",
            graphs[0] >= 1 and graphs == [graphs[0]] * len(graphs),
            "==",
            True,
        ],
        ["held / (full parameters and gradients) x N", held * world_size, "<=", 1.25],
        ["held / (full parameters and gradients) x N, at least", held * world_size, ">=", 0.8],
    ]
    if contract == "a":
        target = {
            k: v + 0.25 if v.is_floating_point() else v + 1
            for k, v in rtp_compile.full_state_dict(model).items()
        }
        rtp_compile.load_full_state_dict(model, target)
        checks += [
            ["full_state_dict keys are state_dict's", result["keys"], "==", True],
            [
                "max |loaded - load_full_state_dict's|",
                _max_diff(rtp_compile.full_state_dict(model), target),
                "<=",
                0.0,
            ],
        ]
    del opt, compiled
    torch._dynamo.reset()
    return checks


def _live_storages(parameters: bool = False) -> dict[int, torch.Tensor]:
    """Every storage a live tensor (found through gc) or its .grad holds, once: data_ptr -> a
    tensor on it (holding it keeps the address from being reused). `parameters`: only
    nn.Parameters and gradients (what backend_jobs.held_fraction counts)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .grad of a non-leaf
        for obj in gc.get_objects():
            if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor):
                continue
            own = obj if not parameters or isinstance(obj, nn.Parameter) else None
            for t in (own, obj.grad):
                try:
                    storage = None if t is None or t.is_meta else t.untyped_storage()
                except (RuntimeError, NotImplementedError):  # a wrapper subclass
                    continue
                if storage is not None and storage.nbytes():
                    out.setdefault(storage.data_ptr(), t)
    return out


def state_bytes(tensor_bytes) -> int:
    """Parameters, gradients and AdamW's state (exp_avg, exp_avg_sq, a scalar step) of
    parameters of `tensor_bytes` each, exactly."""
    step = torch.tensor(
        0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    ).element_size()
    return sum(4 * nbytes + step for nbytes in tensor_bytes)


def cell_memory(family, rank: int, world_size: int, seed: int) -> list:
    """As a user writes it: prog = transform(model, N); gm = prog.module(rank); del model,
    prog; one AdamW step. Then the bytes of every live tensor's storage (each once; the
    tensors alive before the model was built and the batch left out) are at most 1.10 x the
    parameters, gradients and AdamW state of the model's N shards / N, and the user's model and
    its parameters are freed. A dim not divisible by N pads its shards, as FSDP2's chunks do
    (ConvNet's 5 and 7 channels at N = 2: 14% more than its state / N), so the state is the
    shards' as the plan lays them out. Runs before any other cell of the launch."""
    before = _live_storages()
    model = build(family, seed)
    inputs = make_batch(family, seed, rank, 0)
    prog = transform(family, model, world_size, inputs)
    gm = prog.module(rank)
    shards = state_bytes(lay.shard_bytes for lay in prog.plan.params.values())
    model_alive, param_alive = weakref.ref(model), weakref.ref(next(model.parameters()))
    del model, prog
    opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    loss_of(call(gm, inputs), seed).backward()
    opt.step()
    batch = {t.untyped_storage().data_ptr() for t in inputs.values()}
    held = sum(
        t.untyped_storage().nbytes()
        for ptr, t in _live_storages().items()
        if ptr not in before and ptr not in batch
    )
    return [
        [
            "held / ((parameters + gradients + AdamW state of the shards) / N)",
            held / shards,
            "<=",
            1.10,
        ],
        ["the user's model freed", model_alive() is None, "==", True],
        ["its parameter freed", param_alive() is None, "==", True],
    ]


def cell_mesh(family, rank: int, world_size: int, seed: int) -> list:
    """prog.module(mesh=...) on a 2 x 2 (dp, rtp) mesh, transform for the ring's 2: two AdamW
    steps vs DDP over all 4 ranks (train_next_to_ddp, gradients gathered over the ring)."""
    mesh = _mesh((2, 2))
    model = build(family, seed)
    batches = [make_batch(family, seed, rank, step) for step in range(2)]
    prog = transform(family, model, 2, batches[0])
    gm = prog.module(mesh=mesh)
    return _errors(
        train_next_to_ddp(prog, gm, model, batches, seed, call, logits_of, mesh.get_group(1)),
        tolerance(family),
    )


OWN = {
    "mixed_precision": cell_mixed_precision,
    "ac_model": cell_ac_model,
    "ac_user": cell_ac_user,
    "inductor": cell_inductor,
    "backend_a": functools.partial(cell_backend, contract="a"),
    "backend_b": functools.partial(cell_backend, contract="b"),
    "mesh": cell_mesh,
}


# --- the launch ------------------------------------------------------------------------------


def _run(progress, key: str, fn, *args) -> dict:
    """fn(*args)'s checks, or the error it raised (its type and first line), and its time."""
    progress.write(f"{key}\n")
    progress.flush()
    start = time.monotonic()
    try:
        return {"checks": fn(*args), "error": None, "seconds": time.monotonic() - start}
    except Exception as err:  # noqa: BLE001 - a failed cell, whatever it raised
        return {
            "checks": [],
            "error": _first_line(err),
            "trace": traceback.format_exc()[-4000:],
            "seconds": time.monotonic() - start,
        }


def _first_line(err: BaseException) -> str:
    """Type and first line of `err`, and of the first error it was raised while handling (a
    GraphModule re-raising under dynamo says only "Attempt to trace generator")."""

    def line(e):
        return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:200]

    first = err
    while first.__context__ is not None and first.__context__ is not first:
        first = first.__context__
    return line(err) + (f" (while handling {line(first)})" if first is not err else "")


def run_cells(rank: int, world_size: int, cells: list, seed: int, workdir: str) -> dict:
    """Every (feature, family) of `cells` at this world size (MESH: the 2 x 2 mesh), in an
    order that keeps them apart: the memory cells first (nothing else alive yet), then per
    family the cells of its shared program (dropped before the next), then the ones that make
    their own program. (A finished cell's model can outlive it for a moment: the memory and
    backend cells count only what was not alive before they built theirs.)
    Returns (feature, family) -> {"checks", "error", "seconds"}; ("setup", family): the
    shared program's."""
    size = MESH if world_size == MESH else world_size
    todo = set(cells)
    out = {}
    with open(os.path.join(workdir, f"progress-{size}-rank{rank}.txt"), "w") as progress:
        for family in FAMILIES:
            if ("memory", family.id) in todo:
                out[("memory", family.id)] = _run(
                    progress, f"memory {family.id}", cell_memory, family, rank, world_size, seed
                )
        for family in FAMILIES:
            shared = [f for f in SHARED if (f, family.id) in todo]
            if shared:
                holder = []

                def setup():
                    holder.append(Shared(family, rank, world_size, seed, workdir))
                    return []

                out[("setup", family.id)] = _run(progress, f"setup {family.id}", setup)
                for feature in shared:  # a failed setup fails them with its error
                    out[(feature, family.id)] = (
                        _run(progress, f"{feature} {family.id}", SHARED[feature], holder[0])
                        if holder
                        else {**out[("setup", family.id)], "seconds": 0.0}
                    )
                holder.clear()
            for feature, fn in OWN.items():
                if (feature, family.id) in todo:
                    out[(feature, family.id)] = _run(
                        progress, f"{feature} {family.id}", fn, family, rank, world_size, seed
                    )
    return out
