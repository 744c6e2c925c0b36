"""The house's import rules (pyproject's [tool.importlinter] contracts), held by import-linter:
the runtime imports nothing of the compiler, passes nothing of codegen or the program, capture
nothing of passes, codegen or the runtime, and nothing inside the package imports its root."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = [str(pathlib.Path(sys.executable).parent / "lint-imports"), "--no-cache"]


def _lint(tree: pathlib.Path) -> subprocess.CompletedProcess:
    """lint-imports on the package as it lies under `tree` (its pyproject's contracts)."""
    return subprocess.run(LINT, cwd=tree, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tree), "PATH": ""})


@pytest.mark.timeout(300)
def test_import_contracts_are_kept():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "4 kept, 0 broken" in run.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("module,line,contract", [
    ("runtime/units.py", "from rtp_compile.passes.plan import Plan", "The runtime executes"),
    ("passes/rotate.py", "import rtp_compile.codegen", "Passes import nothing"),
    ("capture.py", "from rtp_compile.runtime import ring", "Capture imports nothing"),
    ("program.py", "from rtp_compile import transform", "No inner module imports"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, contract):
    """The contracts are not vacuous: one forbidden import, even inside a function, breaks it."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "rtp_compile", tree / "rtp_compile",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    with open(tree / "rtp_compile" / module, "a") as f:
        f.write(f"\n\ndef _smuggled():\n    {line}\n")
    run = _lint(tree)
    assert run.returncode != 0 and "3 kept, 1 broken" in run.stdout, run.stdout[-3000:]
    report = run.stdout.split("Broken contracts", 1)[1]
    assert report.split("\n")[3].startswith(contract), report[:500]
