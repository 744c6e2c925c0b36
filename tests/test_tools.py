"""The house's tools run clean: ruff's lint and format over the package, tests, benchmarks,
examples and docs scripts, and mypy over the compiler's core and the runtime (their settings:
pyproject.toml). CI runs them here, through the test command."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
TREES = ["rtp_compile", "tests", "benchmarks", "examples", "docs"]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_lint_is_clean():
    run = _run(str(BIN / "ruff"), "check", "--no-cache", *TREES)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_ruff_format_is_kept():
    run = _run(str(BIN / "ruff"), "format", "--check", "--no-cache", *TREES)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.timeout(600)
def test_mypy_passes_on_core_and_runtime():
    run = _run(sys.executable, "-m", "mypy", "--no-incremental")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Success" in run.stdout
