"""Every notebook in notebooks/ executes top to bottom without an error.

The notebooks check their own claims with `assert` statements (the quickstart asserts that the
sharded program's output equals the unsharded model's and its gradients and training equal
DDP's), so a notebook that runs clean is a notebook whose claims hold. Executed in memory: the
files on disk, saved with their outputs for reading on GitHub, are never rewritten.
"""

from __future__ import annotations

import hashlib
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
QUICKSTART = NOTEBOOKS / "01_quickstart.ipynb"


def execute(path: pathlib.Path):
    """Run `path` on a fresh python3 kernel in the notebooks folder; return the executed copy.

    nbclient raises CellExecutionError (with the cell's source and traceback) at the first cell
    that raises."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    return nb


def stdout_of(cell) -> str:
    return "".join(
        o.get("text", "")
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )


def test_quickstart_exists():
    assert QUICKSTART.is_file(), f"{QUICKSTART} is missing"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_saved_with_its_outputs_and_a_figure(path: pathlib.Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), (
        "save the notebook executed (with its outputs) so it reads well on GitHub"
    )
    images = [
        o
        for c in code
        for o in c.get("outputs", [])
        if {"image/png", "image/svg+xml"} & set(o.get("data", {}))
    ]
    assert images, f"{path.name} shows no figure"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs(path: pathlib.Path):
    before = hashlib.sha256(path.read_bytes()).digest()
    nb = execute(path)
    assert hashlib.sha256(path.read_bytes()).digest() == before, f"{path.name} was modified"
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors

    if path == QUICKSTART:
        out = "\n".join(stdout_of(c) for c in nb.cells if c.cell_type == "code")
        assert "ring_shift_start" in out and "ring_wait" in out  # rank 0's code was shown
        assert "(50% of the model)" in out  # rank 0 holds half the bytes
        rows = [
            line.split()
            for line in out.splitlines()
            if line.split()[:1] in (["0"], ["1"]) and len(line.split()) == 10
        ]
        assert [r[0] for r in rows] == ["0", "1"], out  # the comparison table, per rank
        for row in rows:  # output diff, grad error
            assert float(row[1]) < 1e-9 and float(row[2]) < 1e-9, row
        assert "RTP on 2 ranks matches the unsharded model and DDP." in out
