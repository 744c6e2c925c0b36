"""The feature x model-family matrix (rows, columns and what does not apply:
tests/matrix_spec.py; the cells: tests/matrix_cells.py).

One launch per world size runs every cell of that size in sequence (N = 2, then N = 3, whose
checkpoint cells load what N = 2 saved, then 4 processes for the 2 x 2 mesh); each cell is a
test here, failing with its feature, family, capture path, N and what it found. The results go
to RTP_MATRIX_JSON (default: matrix.json in pytest's temporary directory) as JSON, from which
`python docs/make_matrix.py RESULTS.json` draws README's table.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import time

import pytest

pytest.importorskip("transformers")

from matrix_cells import run_cells  # noqa: E402
from matrix_spec import (  # noqa: E402
    CI_CELLS,
    COMPILED,
    FAMILIES,
    FAMILY,
    FEATURE,
    MESH,
    NOT_APPLICABLE,
    cells,
    size_label,
    verdict,
)

import rtp_compile  # noqa: E402

SIZES = (2, 3, MESH)
LAUNCH_TIMEOUT = 1400  # seconds: also the job's collective timeout


class Matrix:
    """Runs a world size's launch when a cell of it is first asked for; writes every result
    known so far, and the cells that do not apply, to `json_path` after each launch."""

    def __init__(self, workdir: pathlib.Path, json_path: pathlib.Path, seed: int, full: bool):
        self.workdir, self.json_path, self.seed = workdir, json_path, seed
        self.full = full  # False: the COMPILED rows are left out
        self.launches: dict[int, dict] = {}

    def cells(self, size: int) -> list[tuple[str, str]]:
        return [c for c in cells(size) if self.full or c[0] not in COMPILED]

    def cell(self, size: int, feature: str, family: str) -> dict:
        if size == 3 and 2 not in self.launches:
            self._launch(2)  # N = 3's checkpoint cells reshard what N = 2 saved
        if size not in self.launches:
            self._launch(size)
        return self.launches[size]["cells"][(feature, family)]

    def _launch(self, size: int) -> None:
        start = time.monotonic()
        try:
            per_rank = rtp_compile.launch(
                run_cells,
                size,
                timeout=LAUNCH_TIMEOUT,
                args=(self.cells(size), self.seed, str(self.workdir)),
            )
            failure = None
        except Exception as err:  # noqa: BLE001 - every cell of the launch fails with it
            per_rank, failure = None, self._launch_failure(size, err)
        seconds = time.monotonic() - start
        results = {}
        for key in self.cells(size):
            results[key] = (
                verdict([r[key] for r in per_rank])
                if per_rank
                else {"status": "fail", "reason": failure, "rank": None, "seconds": 0.0}
            )
        setup = {
            f.id: max(r[("setup", f.id)]["seconds"] for r in per_rank)
            for f in FAMILIES
            if per_rank and ("setup", f.id) in per_rank[0]
        }
        self.launches[size] = {"cells": results, "seconds": seconds, "setup_seconds": setup}
        print(f"matrix launch {size_label(size)}: {seconds:.0f} s")
        self.write()

    def _launch_failure(self, size: int, err: Exception) -> str:
        """What the launch raised, and the cell each rank was running (its progress file)."""
        running = []
        for path in sorted(self.workdir.glob(f"progress-{size}-rank*.txt")):
            lines = path.read_text().splitlines()
            running.append(f"{path.stem.split('-')[-1]}: {lines[-1] if lines else 'nothing'}")
        first = (str(err).strip().splitlines() or [""])[0]
        return (
            f"the launch failed ({type(err).__name__}: {first[:200]}) while running "
            + ", ".join(running)
        )

    def write(self) -> None:
        out = []
        for size, launch in self.launches.items():
            for (feature, family), result in launch["cells"].items():
                out.append({"feature": feature, "family": family, "size": size, **result})
        for (feature, family), reason in NOT_APPLICABLE.items():
            for size in FEATURE[feature].sizes:
                out.append(
                    {
                        "feature": feature,
                        "family": family,
                        "size": size,
                        "status": "n/a",
                        "reason": reason,
                        "seconds": 0.0,
                    }
                )
        self.json_path.write_text(
            json.dumps(
                {
                    "seed": self.seed,
                    "date": time.strftime("%Y-%m-%d"),
                    "launch_seconds": {
                        size_label(s): round(v["seconds"], 1) for s, v in self.launches.items()
                    },
                    "setup_seconds": {
                        size_label(s): v["setup_seconds"] for s, v in self.launches.items()
                    },
                    "cells": out,
                },
                indent=1,
                default=str,
            )
        )


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    # module-scoped, so it draws its own seed the way conftest's `seed` fixture does
    seed = int(os.environ.get("RTP_TEST_SEED", random.randrange(1_000_000)))
    print(f"RTP_TEST_SEED={seed}")
    default = tmp_path_factory.getbasetemp() / "matrix.json"
    json_path = pathlib.Path(os.environ.get("RTP_MATRIX_JSON", default))
    print(f"matrix results: {json_path}")
    return Matrix(tmp_path_factory.mktemp("matrix"), json_path, seed, FULL_RUN)


# The whole matrix takes ~16 minutes on 2 cores, 13 of them the COMPILED rows, more than CI's
# budget beside the rest of the suite: CI runs every other row (about 3 minutes) and the
# COMPILED rows' cells of CI_CELLS (test_ci_cells); RTP_MATRIX=1 (`python docs/make_matrix.py
# --run` sets it) runs them all, and README's table shows that run.
FULL_RUN = os.environ.get("RTP_MATRIX") == "1"
_ONLY_FULL = pytest.mark.skip(
    reason="a row that compiles every family with inductor: with "
    "RTP_MATRIX=1 (python docs/make_matrix.py --run), ~16 minutes"
)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 100)
@pytest.mark.parametrize(
    "size,feature,family",
    [
        pytest.param(
            size,
            feature,
            family,
            id=f"{feature}-{family}-N{size_label(size)}",
            marks=[_ONLY_FULL] if feature in COMPILED and not FULL_RUN else [],
        )
        for size in SIZES
        for feature, family in cells(size)
    ],
)
def test_cell(matrix, size, feature, family):
    result = matrix.cell(size, feature, family)
    column = FAMILY[family]
    assert result["status"] == "pass", (
        f"{FEATURE[feature].title} on {column.title} through {column.path}, "
        f"N = {size_label(size)}, rank {result['rank']}: {result['reason']}\n"
        f"{result.get('trace', '')}"
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ci_cells(seed, tmp_path):
    """The cells of CI_CELLS at N = 2 in one launch, as the full matrix runs them."""
    per_rank = rtp_compile.launch(run_cells, 2, timeout=360, args=(CI_CELLS, seed, str(tmp_path)))
    failed = {}
    for feature, family in CI_CELLS:
        result = verdict([r[(feature, family)] for r in per_rank])
        if result["status"] != "pass":
            failed[f"{FEATURE[feature].title} on {FAMILY[family].header}"] = result["reason"]
    assert not failed, failed
