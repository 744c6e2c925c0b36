"""The house's import rules: pyproject's one `layers` contract, held by import-linter (each
subpackage imports only those below it, siblings nothing of each other), and the module graph,
function-level imports included, acyclic and never pointing at the package root."""

import json
import pathlib
import shutil
import subprocess
import sys

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = [str(pathlib.Path(sys.executable).parent / "lint-imports"), "--no-cache"]


def _lint(tree: pathlib.Path) -> subprocess.CompletedProcess:
    """lint-imports on the package as it lies under `tree` (its pyproject's contracts)."""
    return subprocess.run(
        LINT,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tree), "PATH": ""},
    )


_EDGES = """
import json, grimp
g = grimp.build_graph("rtp_compile", cache_dir=None)
print(json.dumps([[m, t] for m in g.modules for t in g.find_modules_directly_imported_by(m)]))
"""


def _module_graph(tree: pathlib.Path = ROOT) -> nx.DiGraph:
    """Every import between modules of rtp_compile under `tree`, function-level ones included
    (grimp, in a process of its own so that it reads that tree)."""
    run = subprocess.run(
        [sys.executable, "-c", _EDGES],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tree), "PATH": ""},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return nx.DiGraph(json.loads(run.stdout))


@pytest.mark.timeout(300)
def test_the_layers_contract_is_kept():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 kept, 0 broken" in run.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "module,line",
    [
        ("runtime/rotated.py", "from rtp_compile.passes.plan import Plan"),  # up a layer
        ("core/layout.py", "from rtp_compile.runtime import ring"),  # the core, up
        ("passes/rotate.py", "import rtp_compile.codegen.emit"),  # up a layer
        ("capture/trace.py", "from rtp_compile.passes.plan import Plan"),  # a sibling
        ("state/dcp.py", "from rtp_compile.codegen.emit import RankEmitter"),  # a sibling
        ("compiler/program.py", "from rtp_compile.compile_backend import backend"),
    ],
)
def test_an_import_against_the_flow_breaks_the_contract(tmp_path, module, line):
    """The contract is not vacuous: one import against the flow, even inside a function,
    breaks it."""
    tree = tmp_path / "tree"
    shutil.copytree(
        ROOT / "rtp_compile", tree / "rtp_compile", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    with open(tree / "rtp_compile" / module, "a") as f:
        f.write(f"\n\ndef _smuggled():\n    {line}\n")
    run = _lint(tree)
    assert run.returncode != 0 and "0 kept, 1 broken" in run.stdout, run.stdout[-3000:]


def test_the_module_graph_is_acyclic():
    """No module reaches itself through imports, function-level ones included (so no import
    was moved into a function to dodge a cycle)."""
    graph = _module_graph()
    assert graph.number_of_nodes() > 60
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], cycles[:5]


def test_a_cycle_is_found(tmp_path):
    """The acyclicity check sees a cycle hidden in a function."""
    tree = tmp_path / "tree"
    shutil.copytree(
        ROOT / "rtp_compile", tree / "rtp_compile", ignore=shutil.ignore_patterns("__pycache__")
    )
    with open(tree / "rtp_compile" / "core" / "layout.py", "a") as f:
        f.write("\n\ndef _smuggled():\n    from rtp_compile.passes import plan\n")
    assert list(nx.simple_cycles(_module_graph(tree)))


def test_nothing_inside_imports_the_package_root():
    """The root only re-exports the public names; modules import each other directly."""
    graph = _module_graph()
    importers = sorted(m for m in graph.predecessors("rtp_compile") if m != "rtp_compile")
    assert importers == []
