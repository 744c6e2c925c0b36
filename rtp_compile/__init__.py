"""rtp_compile: compile a PyTorch model into per-rank programs that train with Rotated Tensor
Parallelism. The public surface is `transform`, `launch` and `RTPProgram` (see docs/API)."""
from __future__ import annotations

import copy

import torch.fx as fx
from torch import nn

from rtp_compile.capture import CaptureError, canonicalise_parameter_reads, capture
from rtp_compile.materialize import materialize_full
from rtp_compile.program import RTPProgram
from rtp_compile.runtime.launch import RankError, launch
from rtp_compile.passes.fold_parameter_metadata import fold_parameter_metadata
from rtp_compile.passes.fuse import fuse_blocks
from rtp_compile.passes.lower_modules import lower_modules
from rtp_compile.passes.plan import plan_sharding
from rtp_compile.passes.rotate import rotate
from rtp_compile.passes.split_norm_affine import split_norm_affine

__all__ = ["transform", "launch", "RTPProgram", "CaptureError", "RankError", "materialize_full"]


def transform(model: nn.Module, world_size: int, example_inputs=None, *, example_kwargs=None,
              grad_reduction: str = "mean", fuse: bool = True,
              fuse_padding: float = 0.02) -> RTPProgram:
    """Compile `model` for `world_size` ranks; needs no process group.

    Without example inputs the model is traced with torch.fx (or exported with the
    `dummy_inputs` a transformers model carries); with them, torch.export is used.
    `grad_reduction`: "mean" (like DDP) or "sum" over the ranks' batches.
    `fuse`: rotate each MLP / SwiGLU / attention block as one unit (`passes.fuse`), on where
    exact. `fuse_padding`: attention is cut in whole head groups; where N does not divide them,
    a block is fused only if the padding adds at most this share to its weights per rank
    (default 2%; 1.0 allows doubling them for the fused block's speed)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"rtp_compile.transform: world_size must be a positive int, "
                         f"got {world_size!r}")
    if not isinstance(fuse_padding, (int, float)) or fuse_padding < 0:
        raise ValueError(f"rtp_compile.transform: fuse_padding must be a share >= 0 (0.02 = 2%), "
                         f"got {fuse_padding!r}")
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"rtp_compile.transform: grad_reduction must be 'mean' or 'sum', "
                         f"got {grad_reduction!r}")
    captured = capture(model, example_inputs, example_kwargs)
    captured.reference = fx.GraphModule(captured.gm, copy.deepcopy(captured.gm.graph))
    return compile_program(captured, world_size, grad_reduction=grad_reduction, fuse=fuse,
                           fuse_padding=fuse_padding)


def compile_program(captured, world_size: int, **options) -> RTPProgram:
    """The passes, in order, on a captured model (its graph is rewritten in place), and the
    program they make for `world_size` (options: grad_reduction, fuse, fuse_padding)."""
    gm = captured.gm
    if captured.level == "function":
        lower_modules(gm)
        canonicalise_parameter_reads(gm, captured.aliases)  # lowered modules read tied aliases
        fold_parameter_metadata(gm)
    split_norm_affine(gm)
    plan = plan_sharding(gm, world_size, captured.params, captured.aliases)
    if options["fuse"]:
        fuse_blocks(gm, plan, options["fuse_padding"])
    gm, bodies = rotate(gm, plan)
    return RTPProgram(captured, gm, plan, bodies, options)
