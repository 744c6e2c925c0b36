"""Tests for the command line (`python -m rtp_compile`) and the RTP-vs-DDP demo: real runs,
real spawned ranks, no mocks."""

import subprocess
import sys
from pathlib import Path

import pytest

from rtp_compile.demo import run_demo

REPO = Path(__file__).resolve().parents[1]
HEADER = ["step", "rtp", "loss", "ddp", "loss", "|diff|"]  # the loss table's header, split


def _cli(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    """Run `python -m rtp_compile ARGS` from the repository root and capture its output."""
    return subprocess.run([sys.executable, "-m", "rtp_compile", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _loss_rows(stdout: str) -> list[list[str]]:
    """The cells of the loss table: the rows under its header and rule, up to the first non-row."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == HEADER) + 2
    rows = []
    for line in lines[start:]:
        cells = line.split()
        if len(cells) != 4 or not cells[0].isdigit():
            break
        rows.append(cells)
    return rows


@pytest.mark.timeout(300)
def test_demo_command_prints_loss_table():
    proc = _cli("demo", "--steps", "15")
    assert proc.returncode == 0, proc.stderr
    rows = _loss_rows(proc.stdout)
    assert [int(row[0]) for row in rows] == [1, 10, 15]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows)
    assert "RTP param bytes" in proc.stdout and "ratio rtp/ddp" in proc.stdout


@pytest.mark.timeout(300)
def test_demo_trains_and_matches_ddp_with_half_the_parameter_bytes(seed):
    result = run_demo(world_size=2, steps=30, seed=seed)
    rtp, ddp = result["rtp_loss"], result["ddp_loss"]
    assert len(rtp) == len(ddp) == 30
    assert rtp[-1] < 0.7 * rtp[0], rtp
    for step in result["logged_steps"]:
        assert abs(rtp[step - 1] - ddp[step - 1]) <= 1e-4 * abs(ddp[step - 1]), (step, rtp, ddp)
    for rank in range(2):
        assert result["rtp_param_bytes"][rank] <= 0.55 * result["ddp_param_bytes"][rank]
        assert result["rtp_peak_bytes"][rank] > result["rtp_param_bytes"][rank]
    assert result["rtp_step_s"] > 0 and result["ddp_step_s"] > 0


@pytest.mark.timeout(300)
def test_inspect_prints_plan_report_and_rank_code():
    proc = _cli("inspect", "rtp_compile.models:TinyGPT", "--world-size", "2", "--rank", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "bytes/rank" in out and "blocks.0.attn.qkv.weight" in out  # the plan
    assert "rtp_compile program for 2 ranks" in out and "rotated" in out  # the report
    assert "def forward" in out and "ring_shift_start" in out  # rank 1's code
    assert "JobCheck(rank 1 of 2" in out


@pytest.mark.timeout(300)
def test_inspect_unknown_module_exits_2_naming_it():
    proc = _cli("inspect", "nosuch:thing", "--world-size", "2")
    assert proc.returncode == 2
    assert "nosuch" in proc.stderr and "cannot import" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_inspect_factory_not_returning_a_module_exits_2():
    proc = _cli("inspect", "rtp_compile.models:GPTConfig", "--world-size", "2")
    assert proc.returncode == 2
    assert "GPTConfig" in proc.stderr and "not a torch.nn.Module" in proc.stderr
