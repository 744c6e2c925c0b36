"""The README's quick start runs as written."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_start_runs(tmp_path, monkeypatch):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "quick_start.py"
    script.write_text(block)
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ring_shift_start" in run.stdout and "rotate" in run.stdout
    losses = [float(v) for v in re.findall(r"[-\d.]+", run.stdout.strip().splitlines()[-1])]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)  # two ranks, ~ln(96)
