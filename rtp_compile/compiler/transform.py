"""`transform`: capture a model, run the pass pipeline for a world size, make the program."""

from __future__ import annotations

from torch import nn

from rtp_compile.compiler.program import RTPProgram, compile_program
from rtp_compile.passes.manager.context import Options


def transform(
    model: nn.Module,
    world_size: int,
    example_inputs=None,
    *,
    example_kwargs=None,
    grad_reduction: str = "mean",
    fuse: bool = True,
    fuse_padding: float = 0.02,
    small_param_bytes: int = 65536,
    max_bytes_in_flight: int | None = None,
    bucket_bytes: int | str | None = None,
    mp_policy=None,
    disable=(),
    debug: bool = False,
    fixed_layouts=(),
    hardware=None,
) -> RTPProgram:
    """Compile `model` for `world_size` ranks; needs no process group.

    Returns an `RTPProgram`: `prog.module(rank)` is the GraphModule a rank trains with,
    holding only its shards; `prog.plan`, `prog.report()` and `prog.cost(...)` say what it
    does before anything runs.

    Args:
        model: the model; on the meta device too (`prog.module(rank, device=...)` then
            materialises only that rank's shards).
        world_size: the number of ranks of the ring (an int >= 1).
        example_inputs: a tuple of example positional inputs. Without them the model is traced
            with torch.fx (or exported with the `dummy_inputs` a transformers model carries);
            with them, with torch.export.
        example_kwargs: example keyword inputs, for torch.export.
        grad_reduction: "mean" (like DDP) or "sum" of the gradients over the ranks' batches.
        fuse: rotate each MLP / SwiGLU / attention block as one unit (the `fuse_blocks` pass)
            where exact; `fuse=False` is `disable=["fuse_blocks"]`.
        fuse_padding: attention is cut in whole head groups; where N does not divide them, a
            block is fused only if the padding adds at most this share to its weights per rank
            (default 2%; 1.0 allows doubling them for the fused block's speed).
        small_param_bytes: elementwise units (a norm's affine, a layer scale) whose parameters
            hold at most this many bytes are gathered once per step, all in one message per
            hop, instead of rotated (the `gather_small_params` pass; 0: none).
        max_bytes_in_flight: ring message bytes a rank may hold at once in forward; a unit's
            first hop starts during the previous unit's last step where both fit (default: two
            of the largest unit's messages, what one unit holds anyway; 0: no such prefetch).
        bucket_bytes: consecutive rotated and fused units share one ring message per step (a
            bucket, the `bucket_units` pass) while their weights' full bytes fit in it; a
            bucket's later units keep what passes until they compute, as FSDP2 holds a block
            (default None: what the bucket's largest unit would hold gathered; 0: no buckets;
            "auto": the size the time model predicts fastest on `hardware` for the captured
            batch, holding at most `max_bytes_in_flight` or else the default's bound; what
            it compared is `prog.ctx.bucket_choice`).
        mp_policy: a `torch.distributed.fsdp.MixedPrecisionPolicy`, as FSDP2 takes it: the
            shards (what `gm.parameters()` gives the optimizer) stay in the model's dtype;
            forward and backward compute, and the weights rotate, in `param_dtype`; gradients
            are summed over the ranks in `reduce_dtype` and land in `.grad` in the shards'
            dtype; floating inputs are cast to `param_dtype` (`cast_forward_inputs`), floating
            outputs to `output_dtype` if set.
        disable: names of optional passes to skip (`rtp_compile.passes.PIPELINE`).
        debug: log each pass's graph diff at INFO through `logging.getLogger("rtp_compile")`
            and keep its code before and after in `prog.pass_log`.
        fixed_layouts: (parameter name, shard dim or None for flat, granule) of parameters
            already sharded elsewhere, which keep that layout (what `rtp_compile.shard` and the
            compile backend pass; a use that cannot shard along it is gathered, a block that
            would cut it otherwise is not fused).
        hardware: the `rtp_compile.cost.hardware` description (a name, a JSON path) that
            `bucket_bytes="auto"` plans for (default: this machine's, calibrated; a GPU
            cluster's where CUDA is available).

    Raises:
        CaptureError: the model cannot be captured (the message says why and what to pass).
        ValueError: an option out of range, naming it.
    """
    disable = tuple(disable) + (() if fuse else ("fuse_blocks",))
    options = Options(
        grad_reduction,
        fuse_padding,
        small_param_bytes,
        max_bytes_in_flight,
        bucket_bytes,
        disable,
        debug,
        mp_policy,
        fixed_layouts,
        hardware,
    )
    return compile_program(model, world_size, example_inputs, example_kwargs, options)
