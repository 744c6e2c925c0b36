"""The emitted modules work in a job started by torchrun, not only by rtp_compile.launch."""

import pathlib
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_standalone_job(seed, tmp_path):
    script = pathlib.Path(__file__).with_name("torchrun_job.py")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(seed),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        output_err, grad_err = map(float, (tmp_path / f"rank{rank}.txt").read_text().split())
        assert output_err <= 1e-9 and grad_err <= 1e-9
