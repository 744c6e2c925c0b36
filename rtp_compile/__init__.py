"""rtp_compile: compile a PyTorch model into per-rank programs that train with Rotated Tensor
Parallelism. The public surface is `transform`, `launch`, `RTPProgram` and `clip_grad_norm_`
(see docs/API)."""
from rtp_compile.capture import CaptureError
from rtp_compile.clip import clip_grad_norm_
from rtp_compile.compiler import transform
from rtp_compile.materialize import materialize_full
from rtp_compile.program import RTPProgram
from rtp_compile.runtime.launch import RankError, launch

__all__ = ["transform", "launch", "RTPProgram", "CaptureError", "RankError", "materialize_full",
           "clip_grad_norm_"]
