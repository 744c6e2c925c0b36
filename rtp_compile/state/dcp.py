"""Sharded checkpoints of a rank module and its optimizer: torch.distributed.checkpoint (DCP).

    rtp_compile.checkpoint.save(path, gm, optimizer=None, extra=None)   # collective
    extra = rtp_compile.checkpoint.load(path, gm, optimizer=None)       # any world size

The directory is a standard DCP checkpoint of

    {"model":     the model's state_dict keys -> full-shape tensors (a tied weight under each
                  of its names; persistent buffers),
     "optimizer": {"state": {parameter name: {"exp_avg": ..., "step": ...}},
                   "param_groups": [{hyperparameters..., "params": [parameter names]}]},
     "extra":     {"rank<r>": what rank r passed as `extra`, pickled}}

Every rank writes only the real (unpadded) part of its shards, and of the optimizer moments
(which have the shards' shapes); buffers and scalar state (a step count) are the same on every
rank and written once (DCP deduplicates them). No rank gathers a full tensor: a save adds at
most one shard-sized copy per tensor being written. Loading reads, for every shard of the
loading job's layout, the overlapping parts of the saved chunks: a checkpoint saved by N ranks
loads into any world size. `format_utils.dcp_to_torch_save(path, out)` gives a file whose
`["model"]` the original model loads with `load_state_dict(strict=True)`.

A save is written into `<path>.partial` and renamed to `path` when every rank has written:
a job that dies during a save leaves the previous checkpoint at `path` intact. A load reads
into fresh shards and copies them into the parameters and the optimizer only once all of the
checkpoint has been read and checked.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from rtp_compile.runtime.job import job_of
from rtp_compile.state.dcp_planners import ShardChunks, ShardLoadPlanner, ShardSavePlanner
from rtp_compile.state.model_state import computed_state, hooked_native_keys, to_native
from rtp_compile.state.program_state import ProgramState, state_of


def save(
    path,
    gm: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra=None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Collective (every rank of the job, `process_group` default the whole job): write `gm`'s
    shards, its buffers, `optimizer`'s state and this rank's `extra` (any picklable value:
    step, data position, this rank's RNG state) to the DCP checkpoint directory `path`. On a
    2-D mesh (`prog.module(mesh=...)`) only the first replica's ring writes the model and the
    optimizer; every rank writes its `extra`."""
    pstate, job = state_of(gm), job_of(gm)
    state = {}
    if job.replica == 0:  # data-parallel replicas (a 2-D mesh) hold the same shards: one writes
        state["model"] = _model_entries(pstate, gm, job.rank, _job_rank(process_group) == 0)
        if optimizer is not None:
            state["optimizer"] = _optimizer_entries(pstate, gm, optimizer, job.rank)
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    state["extra"] = {f"rank{_job_rank(process_group)}": buffer.getvalue()}
    final = Path(path)
    staging = final.with_name(final.name + ".partial")
    with _collective("save", process_group, f"{final} still holds the previous checkpoint, if any"):
        if _job_rank(process_group) == 0:
            shutil.rmtree(staging, ignore_errors=True)
        _barrier(process_group)
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(staging),
            planner=ShardSavePlanner(),
            process_group=process_group,
        )
        if _job_rank(process_group) == 0:  # every rank has written; the metadata is complete
            previous = final.with_name(final.name + ".previous")
            shutil.rmtree(previous, ignore_errors=True)
            if final.exists():
                os.rename(final, previous)
            os.rename(staging, final)
            shutil.rmtree(previous, ignore_errors=True)
        _barrier(process_group)


def load(
    path,
    gm: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
):
    """Collective: read the checkpoint at `path` (saved by any number of ranks) into `gm`'s
    shards and buffers and into `optimizer` (its parameter groups must name the same
    parameters as the saved ones'); returns the `extra` this rank saved (in a job larger than
    the saving one, a rank that did not save gets rank 0's). Nothing is changed unless all of
    it was read."""
    pstate, rank = state_of(gm), job_of(gm).rank
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"rtp_compile.checkpoint.load: {path} is not a complete DCP "
            f"checkpoint (no .metadata file)"
        )
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    state = {"model": _model_targets(pstate, gm, rank, metadata)}
    if optimizer is not None:
        state["optimizer"] = _optimizer_targets(pstate, gm, optimizer, rank, metadata, path)
    own = f"rank{_job_rank(process_group)}"
    extra_key = own if f"extra.{own}" in metadata.state_dict_metadata else "rank0"
    state["extra"] = {extra_key: None}
    with _collective("load", process_group, "no parameter or optimizer state was changed"):
        dcp.load(
            state, storage_reader=reader, planner=ShardLoadPlanner(), process_group=process_group
        )
    _copy_model(pstate, gm, rank, state["model"], metadata)
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state_dict(gm, optimizer, state["optimizer"]))
    return torch.load(io.BytesIO(state["extra"][extra_key]), weights_only=False)


# -- the model ------------------------------------------------------------------------------
def _model_entries(
    pstate: ProgramState, gm: nn.Module, rank: int, first: bool
) -> dict[str, object]:
    """Every key of the model's state_dict: this rank's shard of each parameter (under each of
    its names); on the job's `first` rank, the buffers (as with DDP, the first rank's are what
    every rank's next forward takes; each rank's own can differ, as BatchNorm's statistics do)
    and the keys the model's state-dict hooks compute, from the full tensors of the modules
    that have hooks (gathered: the only full tensors a save makes)."""
    model, sources = pstate.model, pstate.state_dict_sources
    entries = {}
    for key, source in sources.items():
        name = None if source is None else pstate.alias_of(source)
        if name is not None:
            entries[key] = ShardChunks(gm.get_parameter(name).detach(), pstate.layouts[name], rank)
        elif source is not None and first:
            entries[key] = gm.get_buffer(source).detach()
    if None in sources.values():
        full = {k: pstate.full_tensor(gm, k) for k in hooked_native_keys(model)}  # collective
        if first:
            entries.update(computed_state(model, full, sources, "rtp_compile.checkpoint.save"))
    return {k: entries[k] for k in sources if k in entries}


def _model_targets(
    pstate: ProgramState, gm: nn.Module, rank: int, metadata: Metadata
) -> dict[str, object]:
    """Fresh tensors to read the model into, by state_dict key: a zero shard per parameter
    (read under the first of its keys the checkpoint has), a copy per buffer, a whole tensor
    per key the model's hooks compute; every key and shape checked."""
    sources, saved = pstate.state_dict_sources, metadata.state_dict_metadata
    keys_of: dict[str, list[str]] = {}  # parameter -> its state_dict keys
    for key, source in sources.items():
        if source is not None and pstate.alias_of(source) is not None:
            keys_of.setdefault(pstate.alias_of(source), []).append(key)
    targets, missing, wrong, done = {}, [], [], set()
    for key, source in sources.items():
        name = None if source is None else pstate.alias_of(source)
        if name in done:
            continue
        if name is not None:
            layout = pstate.layouts[name]
            key = next((k for k in keys_of[name] if f"model.{k}" in saved), None)
            if key is None:
                missing.append(f"parameter {'/'.join(keys_of[name])}")
                continue
            done.add(name)
            shape, param = tuple(layout.shape), gm.get_parameter(name)
            targets[key] = ShardChunks(
                torch.zeros(layout.shard_shape, dtype=param.dtype, device=param.device),
                layout,
                rank,
            )
        elif f"model.{key}" not in saved:
            missing.append(key)
            continue
        elif source is not None:
            buffer = gm.get_buffer(source)
            shape, targets[key] = tuple(buffer.shape), torch.empty_like(buffer)
        else:  # computed by a hook: read whole, taken back by the model's load pre-hooks
            md = saved[f"model.{key}"]
            shape = tuple(getattr(md, "size", ()))
            if isinstance(md, TensorStorageMetadata):
                targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
        md = saved[f"model.{key}"]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != shape:
            wrong.append(f"{key} is {_describe(md)} in the checkpoint, the model has {shape}")
    if missing:
        raise KeyError(
            f"rtp_compile.checkpoint.load: the checkpoint has no "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; nothing "
            f"was loaded"
        )
    if wrong:
        raise ValueError(
            f"rtp_compile.checkpoint.load: {'; '.join(wrong[:8])}"
            f"{' ...' if len(wrong) > 8 else ''}; nothing was loaded"
        )
    return targets


def _copy_model(
    pstate: ProgramState, gm: nn.Module, rank: int, loaded: dict[str, object], metadata: Metadata
) -> None:
    """Put what was read into `gm`: shards and buffers as they are; the tensors of modules
    whose hooks compute keys through the model's own load_state_dict (its load pre-hooks), on
    a skeleton, then cut to this rank's shards."""
    model, sources = pstate.model, pstate.state_dict_sources
    with torch.no_grad():
        for key, target in loaded.items():
            if isinstance(target, ShardChunks):
                gm.get_parameter(pstate.alias_of(sources[key])).copy_(target.shard)
            elif sources[key] is not None:
                gm.get_buffer(sources[key]).copy_(target)
        if None not in sources.values():
            return
        stand_ins = {
            k: loaded[k]
            if k in loaded and not isinstance(loaded[k], ShardChunks) and sources[k] is None
            else torch.empty(metadata.state_dict_metadata[f"model.{k}"].size, device="meta")
            for k in sources
            if f"model.{k}" in metadata.state_dict_metadata
        }
        native = to_native(model, stand_ins, "rtp_compile.checkpoint.load")
        for key in hooked_native_keys(model):
            tensor, name = native[key], pstate.alias_of(key)
            if tensor.is_meta:  # passed through unchanged: already read as a shard or buffer
                continue
            if name is not None:
                gm.get_parameter(name).copy_(pstate.layouts[name].shard(tensor, rank))
            else:
                gm.get_buffer(key).copy_(tensor)


# -- the optimizer ----------------------------------------------------------------------------
def _parameter_names(gm: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters, in its state_dict's index order."""
    names = {id(p): n for n, p in gm.named_parameters()}
    order = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"rtp_compile.checkpoint: the optimizer holds a {tuple(p.shape)}"
                    f" tensor that is not a parameter of the rank module; build it "
                    f"on gm.parameters()"
                )
            order.append(names[id(p)])
    return order


def _optimizer_entries(
    pstate: ProgramState, gm: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> dict:
    names = _parameter_names(gm, optimizer)
    saved = optimizer.state_dict()
    state = {}
    for index, values in saved["state"].items():
        name = names[index]
        shard = gm.get_parameter(name)
        state[name] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape == shard.shape:
                value = ShardChunks(value.detach(), pstate.layouts[name], rank)
            elif isinstance(value, torch.Tensor) and value.dim():
                raise ValueError(
                    f"rtp_compile.checkpoint.save: optimizer state {key!r} of "
                    f"{name} has shape {tuple(value.shape)}, neither the shard's "
                    f"{tuple(shard.shape)} nor a scalar; only per-element state "
                    f"(Adam's moments, momentum) and scalars can be sharded"
                )
            state[name][key] = value
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in saved["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _optimizer_targets(
    pstate: ProgramState,
    gm: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    metadata: Metadata,
    path: Path,
) -> dict:
    """What to read the optimizer into, built from the checkpoint's own structure: a zero shard
    per moment, a tensor per scalar state, the saved values of everything else."""
    if not any(k.startswith("optimizer.") for k in metadata.state_dict_metadata):
        raise KeyError(
            f"rtp_compile.checkpoint.load: {path} was saved without an optimizer; "
            f"call load(path, gm) without one"
        )
    names = set(_parameter_names(gm, optimizer))
    targets: dict = {}
    for fqn, md in metadata.state_dict_metadata.items():
        where = metadata.planner_data[fqn]
        if where[0] != "optimizer":
            continue
        if where[1] == "state" and where[2] not in names:
            raise ValueError(
                f"rtp_compile.checkpoint.load: the optimizer's parameter groups "
                f"differ from the saved ones: the checkpoint has state for "
                f"{where[2]}, which the optimizer does not hold"
            )
        if isinstance(md, BytesStorageMetadata):
            value = None
        elif (
            where[1] == "state"
            and tuple(md.size) == tuple(pstate.layouts[where[2]].shape)
            and len(md.size)
        ):
            param = gm.get_parameter(where[2])
            value = ShardChunks(
                torch.zeros(param.shape, dtype=md.properties.dtype, device=param.device),
                pstate.layouts[where[2]],
                rank,
            )
        else:
            value = torch.empty(md.size, dtype=md.properties.dtype)
        set_element(targets, where[1:], value)
    return targets


def _optimizer_state_dict(gm: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict) -> dict:
    """The loaded state as `optimizer.load_state_dict` takes it (parameters by index)."""
    names = _parameter_names(gm, optimizer)
    index = {name: i for i, name in enumerate(names)}
    held = iter(names)
    current = [[next(held) for _ in g["params"]] for g in optimizer.param_groups]
    groups = loaded["param_groups"]
    if [sorted(g["params"]) for g in groups] != [sorted(c) for c in current]:
        raise ValueError(
            "rtp_compile.checkpoint.load: the optimizer's parameter groups differ "
            "from the saved ones; build it on the same parameters, grouped as the "
            "saving job did"
        )
    state = {
        index[name]: {k: v.shard if isinstance(v, ShardChunks) else v for k, v in values.items()}
        for name, values in loaded.get("state", {}).items()
    }
    # load_state_dict pairs each group's "params" with the optimizer's, in the optimizer's order
    return {
        "state": state,
        "param_groups": [{**g, "params": [index[n] for n in c]} for g, c in zip(groups, current)],
    }


# -- helpers ---------------------------------------------------------------------------------
def _describe(md) -> str:
    return f"shape {tuple(md.size)}" if isinstance(md, TensorStorageMetadata) else "not a tensor"


@contextlib.contextmanager
def _collective(what: str, group, state_note: str):
    """Name this rank and the likely cause when a save's or load's collective fails: a peer
    that died (gloo says only "connection closed by peer" and an address) or raised."""
    try:
        yield
    except (RuntimeError, CheckpointException) as err:
        if not dist.is_initialized():
            raise
        raise RuntimeError(
            f"rtp_compile.checkpoint.{what}: rank {dist.get_rank(group)} of "
            f"{dist.get_world_size(group)} failed in the {what}'s collectives: another rank "
            f"probably died or raised (see its error); {state_note}. "
            f"{type(err).__name__}: {err}"
        ) from err


def _job_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group)
