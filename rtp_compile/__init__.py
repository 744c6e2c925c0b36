"""rtp_compile: compile a PyTorch model into per-rank programs that train with Rotated Tensor
Parallelism. The public surface is `transform`, `launch`, `RTPProgram`, `clip_grad_norm_`,
and for looking at a run `record_traces` and `timeline` (see docs/API)."""
from rtp_compile.capture import CaptureError
from rtp_compile.clip import clip_grad_norm_
from rtp_compile.compiler import transform
from rtp_compile.materialize import materialize_full
from rtp_compile.program import RTPProgram
from rtp_compile.runtime.launch import RankError, launch
from rtp_compile.timeline import timeline  # the function: rtp_compile.timeline(traces, path)
from rtp_compile.traces import record_runs, record_traces

__all__ = ["transform", "launch", "RTPProgram", "CaptureError", "RankError", "materialize_full",
           "clip_grad_norm_", "timeline", "record_traces", "record_runs"]


def __getattr__(name: str):
    """`rtp_compile.checkpoint` on first use (torch.distributed.checkpoint takes ~0.7 s to
    import, which a job that never saves need not pay)."""
    if name == "checkpoint":
        import importlib
        return importlib.import_module("rtp_compile.checkpoint")
    raise AttributeError(f"module 'rtp_compile' has no attribute {name!r}")
