"""`rtp-compile calibrate`: a quick real calibration (two gloo ranks, then the fake-group runtime
overhead) writes a hardware description with every key, each number positive and finite."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rtp_compile.apps.calibrate import run
from rtp_compile.apps.cli import main

REPO = Path(__file__).resolve().parents[1]
COMPUTE = {
    "matmul_flops",
    "memory_bandwidth",
    "op_overhead_s",
    "backward_factor",
    "compute_factor",
}
FITS = {"ring_hop", "all_reduce", "all_gather", "reduce_scatter"}


def _positive(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _check_compute(compute: dict) -> None:
    assert set(compute) == COMPUTE
    assert "float32" in compute["matmul_flops"]
    assert all(_positive(v) for v in compute["matmul_flops"].values())
    assert _positive(compute["memory_bandwidth"]) and _positive(compute["op_overhead_s"])
    assert 1 < compute["backward_factor"] < 10  # a block's backward: more than its forward
    # a real block against its ops' roofline at the rates measured beside it: near 1, and not
    # far faster than the roofline (which would mean the rates were mismeasured)
    assert 0.7 < compute["compute_factor"] < 5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_calibration_writes_every_key_positive(tmp_path):
    path = tmp_path / "hw.json"
    written = run([2], path, "t", quick=True)
    hw = json.loads(path.read_text())
    assert hw == written
    assert set(hw) == {"name", "source", "cores", "compute", "levels", "runtime", "measured"} | {
        "notes",
        "host_runs_ahead",
        "overlap",
    }
    assert hw["name"] == "t" and hw["source"].startswith("rtp-compile calibrate, ")
    assert isinstance(hw["cores"], int) and hw["cores"] >= 1
    _check_compute(hw["compute"])
    (level,) = hw["levels"]
    assert level["name"] == "loopback (gloo)" and level["ranks"] is None
    assert level["latency_s"] >= 0 and _positive(level["bandwidth"])
    assert set(hw["runtime"]) == {
        "rtp_step_overhead_s",
        "fsdp_block_overhead_s",
        "fsdp_optimizer_overhead_s",
    }
    assert _positive(hw["runtime"]["rtp_step_overhead_s"])
    assert hw["overlap"] is False and hw["host_runs_ahead"] is False
    assert list(hw["measured"]) == ["2"]
    two = hw["measured"]["2"]
    assert set(two) == COMPUTE | FITS | set(hw["runtime"])
    assert all(two[k] >= 0 and math.isfinite(two[k]) for k in hw["runtime"])
    _check_compute({k: two[k] for k in COMPUTE})
    assert two["matmul_flops"] == hw["compute"]["matmul_flops"]
    for op in FITS:
        alpha, beta = two[op]
        assert math.isfinite(alpha) and alpha >= 0 and _positive(beta), (op, two[op])
    assert level["bandwidth"] == pytest.approx(1 / two["ring_hop"][1])
    assert level["latency_s"] == two["ring_hop"][0]
    assert two["rtp_step_overhead_s"] == hw["runtime"]["rtp_step_overhead_s"]
    assert hw["notes"] and all(isinstance(note, str) for note in hw["notes"])


def test_calibrate_help_and_usage_errors(capsys):
    proc = subprocess.run(
        [sys.executable, "-m", "rtp_compile", "calibrate", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for option in ("--world-sizes", "--out", "--name", "--quick"):
        assert option in proc.stdout
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--world-sizes", "1", "2"])
    assert exc.value.code == 2
    assert "calibrate: error: --world-sizes must be >= 2" in capsys.readouterr().err
