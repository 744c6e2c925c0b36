"""`passes/` ships as `rtp_compile.passes` in a normal (non-editable) install too."""
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_wheel_maps_passes_into_the_package(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = tmp_path.glob("rtp_compile-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ROOT.joinpath("passes").glob("*.py"):
        assert f"rtp_compile/passes/{module.name}" in names
    assert "rtp_compile/runtime/ring.py" in names
    assert not any(n.startswith("passes/") for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)


def test_editable_install_imports_passes_from_the_source_tree():
    import rtp_compile.passes.plan as plan
    assert pathlib.Path(plan.__file__).resolve() == ROOT / "passes" / "plan.py"
