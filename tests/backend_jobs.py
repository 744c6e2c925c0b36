"""Jobs the compile-backend tests run on every rank (rtp_compile.launch, gloo, float64)."""

from __future__ import annotations

import copy
import gc
import math
import pickle

import torch
import torch.distributed as dist
from jobs import LR, loss_of, rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rtp_compile
from rtp_compile.state import shard_registry

STEPS = 3


def tiny_gpt():
    from rtp_compile.apps.models import GPTConfig, TinyGPT

    return TinyGPT(GPTConfig(vocab_size=29, block_size=16, n_layer=2, n_head=2, n_embd=12))


def models():
    """name -> (factory, batch(rank, step, rows), logits of an output)."""
    from hf_zoo import _gpt2, _llama

    def tokens(rank, step, rows=2):
        g = torch.Generator().manual_seed(100 * rank + step)
        return torch.randint(0, 29, (rows, 7), generator=g)

    return {
        "tinygpt": (tiny_gpt, lambda m, x: m(x), lambda o: o),
        "gpt2": (_gpt2, lambda m, x: m(input_ids=x), lambda o: o.logits),
        "llama": (_llama, lambda m, x: m(input_ids=x), lambda o: o.logits),
    }, tokens


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every parameter's full gradient from the shards' .grad of all ranks."""
    out = {}
    for name, p in model.named_parameters():
        entry = shard_registry.entry_of(p)
        grad = entry.shard.grad
        grad = torch.zeros_like(entry.shard) if grad is None else grad.contiguous()
        shards = [torch.empty_like(grad) for _ in range(entry.layout.world_size)]
        dist.all_gather(shards, grad)
        out[name] = entry.layout.unshard(shards)
    return out


def held_fraction(model: nn.Module) -> float:
    """Bytes of every parameter alive in this process (found through gc: full, shard or any
    other) and of every gradient any tensor holds, by storage, over the bytes the model's full
    parameters and their gradients take."""
    gc.collect()
    from torch._subclasses.fake_tensor import FakeTensor

    storages = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor) or obj.is_meta:
            continue
        for t in (obj if isinstance(obj, nn.Parameter) else None, obj.grad):
            if t is not None and not isinstance(t, FakeTensor) and t.untyped_storage().nbytes():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    full = sum(
        2 * math.prod(shard_registry.entry_of(p).layout.shape) * p.element_size()
        for p in model.parameters()
    )
    return sum(storages.values()) / full


def held_state_fraction(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Bytes of every tensor alive in this process (found through gc, each storage once; plain
    tensors and parameters: a subclass wraps one of those or holds nothing) over those of the
    model's full parameters, their gradients and `optimizer`'s state for them (its tensors per
    element: AdamW's two moments), divided by the world size."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        for t in (obj, obj.grad):
            if type(t) not in (torch.Tensor, nn.Parameter) or t.is_meta:
                continue
            try:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except RuntimeError:  # an "invalid python storage": a fake tensor's, no memory
                continue
    state = next(s for s in optimizer.state.values() if s)
    per_element = sum(torch.is_tensor(v) and v.dim() > 0 for v in state.values())
    full = sum(
        math.prod(shard_registry.entry_of(p).layout.shape) * p.element_size()
        for p in model.parameters()
    )
    return sum(storages.values()) / ((2 + per_element) * full / dist.get_world_size())


def bound_bytes() -> int:
    """Bytes the rank modules of the programs alive hold in the parameters and buffers every
    call binds, beyond a one-element placeholder each (a copy of a buffer, a shard)."""
    from rtp_compile.compile_backend.backend import BoundRankProgram

    held = 0
    for obj in gc.get_objects():
        if isinstance(obj, BoundRankProgram):
            gm = obj.rank_gm
            tensors = {
                **dict(gm.named_parameters(remove_duplicate=False)),
                **dict(gm.named_buffers(remove_duplicate=False)),
            }
            held += sum(
                max(tensors[n].untyped_storage().nbytes() - tensors[n].element_size(), 0)
                for n in [*obj.layouts, *obj.buffers]
            )
    return held


def train_compiled_next_to_ddp(
    model, call, logits, tokens, rank, seed, contract, backend, steps: int = STEPS
) -> dict:
    """Train `model` compiled with `backend` (contract "b": optimizer built first, then
    compiled; "a": rtp_compile.shard first) next to DDP for `steps` AdamW steps; the max relative
    errors of the first output (vs the eager model), the first gradients and the parameters
    after each step (vs DDP), and what the backend made."""
    reference, ddp = copy.deepcopy(model), DDP(copy.deepcopy(model))
    if contract == "a":
        rtp_compile.shard(model)
    # eps=1e-3, as in compile_jobs: Adam's first update has slope lr/eps at g = 0, and 1e-6
    # would make float32 rounding in a near-zero gradient a parameter difference of ~0.1*lr
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)
    compiled = torch.compile(model, backend=backend)
    errors = {"output": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0}
    graphs = []
    for step in range(steps):
        x = tokens(rank, seed + step)
        out = logits(call(compiled, x))
        if step == 0:
            errors["output"] = rel_err(out, logits(call(reference, x)))
        loss = loss_of(out, seed + step)
        loss.backward()
        ddp_loss = loss_of(logits(call(ddp, x)), seed + step)
        ddp_loss.backward()
        errors["loss"] = max(errors["loss"], rel_err(loss.detach(), ddp_loss.detach()))
        if step == 0:
            ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
            errors["grad"] = max(
                rel_err(g, ddp_grads[n], 1e-6) for n, g in full_grads(model).items()
            )
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
        full = rtp_compile.full_state_dict(model)
        errors["param"] = max(
            errors["param"],
            max(rel_err(full[k], v, LR) for k, v in ddp.module.state_dict().items()),
        )
        graphs.append(len(backend.programs))
    if contract == "a":  # run uncompiled, the sharded model gathers each weight it reads
        x = tokens(rank, seed + steps)
        out, ddp_out = logits(call(model, x)), logits(call(ddp, x))
        errors["eager"] = rel_err(out, ddp_out)
        loss_of(out, seed).backward()
        loss_of(ddp_out, seed).backward()
        ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
        errors["eager_grad"] = max(
            rel_err(g, ddp_grads[n], 1e-6) for n, g in full_grads(model).items()
        )
        errors["clip"] = rel_err(
            rtp_compile.clip_grad_norm_(model, 0.05),
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05),
        )
        opt.zero_grad()
        with torch.no_grad():  # a state to load that differs from the model's
            target = {
                k: v + 0.5 if v.is_floating_point() else v
                for k, v in ddp.module.state_dict().items()
            }
        rtp_compile.load_full_state_dict(model, target)
        loaded = rtp_compile.full_state_dict(model)
        errors["load"] = max((loaded[k] - v).abs().max().item() for k, v in target.items())
    return (
        {
            **errors,
            "graphs": graphs,
            "sharded": all(shard_registry.entry_of(p) is not None for p in model.parameters()),
            "keys": list(rtp_compile.full_state_dict(model)) == list(model.state_dict().keys())
            if contract == "a"
            else None,
        },
        opt,
        compiled,
    )


def compiled_parity(rank: int, world_size: int, cases: list, seed: int) -> dict:
    """train_compiled_next_to_ddp for each (model, contract, rank compiler) of `cases`, in
    float64."""
    torch.set_default_dtype(torch.float64)
    zoo, tokens = models()
    results = {}
    for name, contract, rank_compiler in cases:
        factory, call, logits = zoo[name]
        torch.manual_seed(seed)
        model = factory().to(torch.float64)
        torch._dynamo.reset()
        backend = rtp_compile.backend(rank_compiler=rank_compiler)
        result, opt, compiled = train_compiled_next_to_ddp(
            model, call, logits, tokens, rank, seed, contract, backend
        )
        # with gradients, the reference runs gone
        loss_of(logits(call(compiled, tokens(rank, seed))), seed).backward()
        result["held"] = held_fraction(model)
        results[(name, contract, rank_compiler)] = result
        del model, opt, compiled
    return results


def default_backend(rank: int, world_size: int, name: str, seed: int) -> dict:
    """`name` in float32 through `rtp_compile.backend()` with every default (the rank programs
    compiled whole by inductor), the optimizer built first (contract b), 2 AdamW steps next to
    DDP; and the frames dynamo compiled for rank programs: all it compiled (the model's graphs,
    one per program, and the rank programs') less the model's."""
    torch.set_default_dtype(torch.float32)
    zoo, tokens = models()
    factory, call, logits = zoo[name]
    torch.manual_seed(seed)
    model = factory().to(torch.float32)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    backend = rtp_compile.backend()
    result, opt, compiled = train_compiled_next_to_ddp(
        model, call, logits, tokens, rank, seed, "b", backend, steps=2
    )
    result["programs"] = len(backend.programs)
    result["rank_frames"] = counters["stats"]["unique_graphs"] - len(backend.programs)
    loss_of(logits(call(compiled, tokens(rank, seed))), seed).backward()  # with gradients
    result["held"] = held_fraction(model)
    result["held_state"] = held_state_fraction(model, opt)
    result["bound_bytes"] = bound_bytes()
    return result


class Layer(nn.Module):
    """Two linears with a graph break between them: one dynamo graph per half, shared by every
    layer (same shapes)."""

    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, h):
        h = torch.tanh(self.a(h))
        torch._dynamo.graph_break()
        return h + self.b(h)


class Broken(nn.Module):
    """An embedding tied to the head, identical layers broken in the middle: the tied weight is
    read in the first graph (embedding) and the last (head)."""

    def __init__(self, vocab: int = 23, width: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layer0, self.layer1 = Layer(width), Layer(width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        # no loop: dynamo skips a whole frame whose loop body breaks the graph (it would run
        # eagerly, full parameters and all)
        h = self.layer1(self.layer0(self.emb(x)))
        return self.head(self.norm(h))


def _raises(fn) -> str:
    """The message of the error `fn()` raises ('' if none)."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return ""


def graph_breaks(rank: int, world_size: int, contract: str, seed: int) -> dict:
    """Broken trained next to DDP through batch-size changes and a no_grad evaluation, with
    `rtp_compile.clip_grad_norm_`; what the backend compiled at each step; the errors of a
    released model's repr / deepcopy / state_dict / pickle; a load_full_state_dict round trip."""
    torch.set_default_dtype(torch.float64)
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = Broken()
    ddp = DDP(copy.deepcopy(model))
    if contract == "a":
        rtp_compile.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    rank_modules = []  # what the rank compiler is handed: each emitted rank module, once
    backend = rtp_compile.backend(rank_compiler=lambda gm, example: rank_modules.append(gm) or gm)
    compiled = torch.compile(model, backend=backend)
    counters = torch._dynamo.utils.counters
    out = {"loss": 0.0, "param": 0.0, "norm": 0.0, "graphs": [], "frames": []}
    for step, rows in enumerate([2, 2, 2, 3, 3, 2]):
        g = torch.Generator().manual_seed(seed + 10 * rank + step)
        x = torch.randint(0, 23, (rows, 5), generator=g)
        loss, ddp_loss = loss_of(compiled(x), step), loss_of(ddp(x), step)
        loss.backward()
        ddp_loss.backward()
        norm = rtp_compile.clip_grad_norm_(model, 0.5)
        ddp_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        opt.step()
        ddp_opt.step()
        opt.zero_grad()
        ddp_opt.zero_grad()
        out["loss"] = max(out["loss"], rel_err(loss.detach(), ddp_loss.detach()))
        out["norm"] = max(out["norm"], rel_err(norm, ddp_norm))
        full = rtp_compile.full_state_dict(model)
        out["param"] = max(
            out["param"], max(rel_err(full[k], v, LR) for k, v in ddp.module.state_dict().items())
        )
        out["graphs"].append(len(backend.programs))
        out["frames"].append(counters["stats"]["unique_graphs"])
    with torch.no_grad():
        x = torch.randint(0, 23, (4, 5))
        out["eval"] = rel_err(compiled(x), ddp.module(x))
    out["graphs"].append(len(backend.programs))
    out["rank_modules"] = len(rank_modules)
    shards = {id(shard_registry.entry_of(p).shard) for p in model.parameters()}
    out["one_shard_each"] = len(shards) == len(list(model.parameters()))
    out["tied_layout"] = shard_registry.entry_of(model.emb._parameters["weight"]).layout.dim
    out["plans"] = [str(p.plan) for p in backend.programs]
    if contract == "b":
        weight = model.layer0.a.weight
        out["released"] = weight.untyped_storage().nbytes() == 0
        out["errors"] = {
            "repr": _raises(lambda: repr(weight)),
            "deepcopy": _raises(lambda: copy.deepcopy(model)),
            "state_dict": _raises(model.state_dict),
            "pickle": _raises(lambda: pickle.dumps(weight)),
            "load_state_dict": _raises(lambda: model.load_state_dict(ddp.module.state_dict())),
        }
    torch.manual_seed(seed + 1)
    fresh = Broken().state_dict()  # another initialisation (its tied keys equal)
    rtp_compile.load_full_state_dict(model, fresh)
    loaded = rtp_compile.full_state_dict(model)
    out["loaded"] = max((loaded[k] - v).abs().max().item() for k, v in fresh.items())
    out["stepped_first"] = stepped_before_compiling(rank, world_size)
    return out


def stepped_before_compiling(rank: int, world_size: int) -> str:
    """An optimizer that stepped the full parameters before the model was compiled: its next
    step after the first compiled call must refuse (its state has the full shapes)."""
    torch.set_default_dtype(torch.float64)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    torch.compile(model, backend="rtp")(torch.randn(2, 6)).sum().backward()
    return _raises(opt.step)


def mixed_precision(rank: int, world_size: int, names: list, seed: int) -> dict:
    """Per model: the loss and full gradients of one step of FSDP2 with a bfloat16 policy, of
    FSDP2 in float32, and of the model sharded with the policy (`rtp_compile.shard(model,
    mp_policy=...)`) and compiled by the backend with it; and what the backend says of the same
    policy on a model it was not sharded with (contract b)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    table, tokens = models()
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name in names:
        factory, call, logits = table[name]
        torch.manual_seed(seed)
        model, x = factory().float(), tokens(rank, 0)
        result = {}
        for tag, kwargs in (("fp32", {}), ("fsdp2", {"mp_policy": policy})):
            fsdp = fully_shard(copy.deepcopy(model), mesh=mesh, **kwargs)
            loss = logits(call(fsdp, x)).float().pow(2).mean()
            loss.backward()
            result[tag] = (
                loss.item(),
                {n: p.grad.full_tensor() for n, p in fsdp.named_parameters()},
            )
        plain = copy.deepcopy(model)
        sharded = rtp_compile.shard(
            model,
            world_size,
            example_kwargs={"input_ids": x} if name != "tinygpt" else None,
            example_inputs=(x,) if name == "tinygpt" else None,
            mp_policy=policy,
        )
        compiled = torch.compile(
            sharded,
            backend=rtp_compile.backend(world_size, rank_compiler="eager", mp_policy=policy),
        )
        loss = logits(call(compiled, x)).float().pow(2).mean()
        loss.backward()
        result["rtp"] = (loss.item(), full_grads(sharded))
        result["refused"] = _raises(
            lambda: call(
                torch.compile(
                    plain,
                    backend=rtp_compile.backend(
                        world_size, rank_compiler="eager", mp_policy=policy
                    ),
                ),
                x,
            )
        )
        out[name] = result
    return out
