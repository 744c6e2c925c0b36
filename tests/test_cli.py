"""Tests for the command line (`python -m rtp_compile`) and the RTP-vs-DDP demo: real runs,
real spawned ranks, no mocks."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rtp_compile.apps.corpus import ALPHABET
from rtp_compile.apps.demo import BATCH_SIZE, PROMPT, SAMPLE_CHARS, run_demo

REPO = Path(__file__).resolve().parents[1]
HEADER = ["step", "rtp", "loss", "ddp", "loss", "|diff|"]  # the loss table's header, split


def _cli(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    """Run `python -m rtp_compile ARGS` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "rtp_compile", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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


RATIO_LINE = re.compile(
    r"^time per step \(median\): rtp [\d.]+ ms, ddp [\d.]+ ms, "
    r"ratio rtp/ddp [\d.]+$",
    re.M,
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_command_trains_on_the_text_and_writes_a_sample():
    proc = _cli("demo", "--steps", "20")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "text: Shakespeare" in out and "float32" in out
    rows = _loss_rows(out)
    assert [int(row[0]) for row in rows] == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    rtp, ddp = [float(row[1]) for row in rows], [float(row[2]) for row in rows]
    assert 4.3 < rtp[0] < 4.8  # ~ln(96): the untrained model guesses uniformly
    assert rtp[-1] < 0.8 * rtp[0], rtp  # the loss falls on the text
    for step, a, b in zip(rows, rtp, ddp):  # float32: agree until AdamW amplifies the rounding
        if int(step[0]) <= 10:
            assert abs(a - b) <= 1e-4 * b, rows
    assert "RTP param bytes" in out and "RTP peak step bytes" in out
    assert RATIO_LINE.search(out), out
    assert re.search(
        rf"^tokens/s \(all 2 ranks, {2 * BATCH_SIZE * 32:,} tokens a step\): "
        r"rtp [\d,]+, ddp [\d,]+",
        out,
        re.M,
    ), out
    sample = out.split("seed 0):\n", 1)[1]
    assert sample.startswith(PROMPT) and len(sample.rstrip("\n")) >= len(PROMPT) + 250, sample
    assert "training: 100%" in proc.stderr and "20/20" in proc.stderr  # rank 0's tqdm bar


@pytest.fixture(scope="module")
def float64_demo():
    """20 steps of the demo in float64, at a fresh seed (printed, replayed by RTP_TEST_SEED)."""
    seed = int(os.environ.get("RTP_TEST_SEED", random.randrange(1_000_000)))
    print(f"RTP_TEST_SEED={seed}")
    return seed, run_demo(world_size=2, steps=20, seed=seed, dtype=torch.float64, progress=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_in_float64_matches_ddp_to_rounding_and_learns_the_text(float64_demo):
    _, result = float64_demo
    rtp, ddp = result["rtp_loss"], result["ddp_loss"]
    assert len(rtp) == len(ddp) == 20
    for step in range(20):
        assert abs(rtp[step] - ddp[step]) <= 1e-8 * ddp[step], (step, rtp, ddp)
    assert result["max_param_diff"] <= 1e-8
    assert rtp[-1] < 0.8 * rtp[0], rtp
    assert result["held_out_rtp"] < result["held_out_before"] - 0.8, result
    assert abs(result["held_out_rtp"] - result["held_out_ddp"]) <= 1e-8
    for rank in range(2):
        assert result["rtp_param_bytes"][rank] <= 0.55 * result["ddp_param_bytes"][rank]
        assert result["rtp_peak_bytes"][rank] > result["rtp_param_bytes"][rank]
    assert result["rtp_step_s"] > 0 and result["ddp_step_s"] > 0
    assert result["rtp_tokens_per_s"] == pytest.approx(2 * BATCH_SIZE * 32 / result["rtp_step_s"])
    sample = result["sample"]
    assert sample.startswith(PROMPT) and len(sample) == len(PROMPT) + SAMPLE_CHARS
    assert set(sample) <= set(ALPHABET)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_stopped_and_resumed_from_its_checkpoint_trains_as_if_never_stopped(
    float64_demo, tmp_path
):
    # 13 steps saving every 6 (the last checkpoint is step 12's), then resumed up to 20: every
    # loss of RTP and of the DDP replica equals the uninterrupted run's, bitwise
    seed, straight = float64_demo
    directory = str(tmp_path / "ck")
    run_demo(
        world_size=2,
        steps=13,
        seed=seed,
        dtype=torch.float64,
        progress=False,
        track_memory=False,
        checkpoint_dir=directory,
        checkpoint_every=6,
    )
    resumed = run_demo(
        world_size=2,
        steps=20,
        seed=seed,
        dtype=torch.float64,
        progress=False,
        track_memory=False,
        checkpoint_dir=directory,
        resume=True,
    )
    assert resumed["rtp_loss"][12:] == straight["rtp_loss"][12:]
    assert resumed["ddp_loss"][12:] == straight["ddp_loss"][12:]
    assert resumed["rtp_loss"][:12] == straight["rtp_loss"][:12]  # the records came back
    assert resumed["sample"] == straight["sample"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inspect_prints_plan_report_and_rank_code():
    proc = _cli("inspect", "rtp_compile.apps.models:TinyGPT", "--world-size", "2", "--rank", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "bytes/rank" in out and "blocks.0.attn.qkv.weight" in out  # the plan
    assert "rtp_compile program for 2 ranks" in out and "rotated" in out  # the report
    assert "def forward" in out and "ring_shift_start" in out  # rank 1's code
    assert "JobCheck(rank 1 of 2" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inspect_unknown_module_exits_2_naming_it():
    proc = _cli("inspect", "nosuch:thing", "--world-size", "2")
    assert proc.returncode == 2
    assert "nosuch" in proc.stderr and "cannot import" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inspect_factory_not_returning_a_module_exits_2():
    proc = _cli("inspect", "rtp_compile.apps.models:GPTConfig", "--world-size", "2")
    assert proc.returncode == 2
    assert "GPTConfig" in proc.stderr and "not a torch.nn.Module" in proc.stderr
