"""rtp_compile: compile a PyTorch model into per-rank programs that train with Rotated Tensor
Parallelism. The public surface is `transform`, `launch`, `RTPProgram`, `clip_grad_norm_`;
for looking at a run `record_traces` and `timeline`; for torch.compile `backend` (also
`backend="rtp"`), `shard`, `full_state_dict` and `load_full_state_dict`; `checkpoint` (DCP
save and load, imported on first use). README.md shows each in use; docs/design.md says how
the package is laid out."""

from rtp_compile.capture.trace import CaptureError
from rtp_compile.compile_backend.backend import backend, register_rtp_backend
from rtp_compile.compile_backend.sharded_model import full_state_dict, load_full_state_dict, shard
from rtp_compile.compiler.program import RTPProgram
from rtp_compile.compiler.transform import transform
from rtp_compile.inspect.timeline import (
    timeline,  # the function: rtp_compile.timeline(traces, path)
)
from rtp_compile.inspect.traces import record_runs, record_traces
from rtp_compile.runtime.launch import RankError, launch
from rtp_compile.state.clip import clip_grad_norm_
from rtp_compile.state.materialize import materialize_full

__all__ = [
    "transform",
    "launch",
    "RTPProgram",
    "CaptureError",
    "RankError",
    "materialize_full",
    "clip_grad_norm_",
    "timeline",
    "record_traces",
    "record_runs",
    "backend",
    "shard",
    "full_state_dict",
    "load_full_state_dict",
]

register_rtp_backend()


def __getattr__(name: str):
    """`rtp_compile.checkpoint` on first use (torch.distributed.checkpoint takes ~0.7 s to
    import, which a job that never saves need not pay)."""
    if name == "checkpoint":
        import importlib

        return importlib.import_module("rtp_compile.state.dcp")
    raise AttributeError(f"module 'rtp_compile' has no attribute {name!r}")
