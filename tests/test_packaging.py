"""A normal (non-editable) install ships every module of the package, its data (the demo's text)
and the console script."""

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_ships_every_module_of_the_package(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = tmp_path.glob("rtp_compile-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / "rtp_compile").rglob("*.py")]
    assert modules and set(modules) <= names
    assert {"rtp_compile/passes/plan.py", "rtp_compile/runtime/ring.py"} <= names
    assert any(n.endswith("entry_points.txt") for n in names)
    # the demo's text and its source note (package data, read with importlib.resources)
    assert {"rtp_compile/apps/data/tinyshakespeare.txt", "rtp_compile/apps/data/README.md"} <= names
