"""The rooms stay apart: the package's layers hold (pyproject's [tool.importlinter] contract, every import counted,
those inside functions too), no two subpackages import each other, and the control plane's own modules never
import torch (they pass numpy arrays)."""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

import openrl_lab

ROOT = Path(openrl_lab.__file__).parent
TORCH_FREE = [
    "gateway",
    "kernel/client.py",
    "cluster",
    "home.py",
    "sockets.py",
    "server.py",
    "cli.py",
    "train/loss_spec.py",
    "train/__init__.py",
    "orchestrator",
    "sandbox",
    "memory.py",
    "identity.py",
    "kernel/join.py",
    "version.py",
]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
            if node.module.startswith("openrl_lab.train.") and node.module != "openrl_lab.train.loss_spec":
                names.add("openrl_lab.train (torch side)")
    return names


def test_control_plane_modules_do_not_import_torch():
    files = []
    for entry in TORCH_FREE:
        p = ROOT / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    assert len(files) >= 8
    assert ROOT / "cluster" / "kubernetes.py" in files  # the Kubernetes launcher runs inside the control plane
    offenders = {
        str(f.relative_to(ROOT)): sorted(n for n in _imports(f) if n in ("torch", "openrl_lab.train (torch side)"))
        for f in files
    }
    assert {f: n for f, n in offenders.items() if n} == {}


def test_the_layers_contract_holds(capsys):
    code = lint_imports(config_filename=str(ROOT.parent / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, capsys.readouterr().out[-4000:]


def _part(module: str) -> str:
    """The subpackage (or top-level module) a module belongs to; "openrl_lab" for the package root itself."""
    return module.split(".")[1] if "." in module else module


def test_no_two_parts_of_the_package_import_each_other():
    """A cycle through any import (also one made inside a function), and the package root as a part of its own: an
    import of `openrl_lab` itself (say `from openrl_lab import __version__`) would close a cycle through its entry
    points into the notebook layer."""
    graph = grimp.build_graph("openrl_lab", cache_dir=None)
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for module in graph.modules:
        for target in graph.find_modules_directly_imported_by(module):
            a, b = _part(module), _part(target)
            if a != b:
                edges[a].add(b)
                where.setdefault((a, b), f"{module} -> {target}")
    assert not [m for (a, b), m in where.items() if b == "openrl_lab"], "nothing imports the package root"
    # every pair that reaches each other closes a cycle: report each with one import of each direction
    reach = {a: _reachable(edges, a) for a in list(edges)}
    cycles = sorted({tuple(sorted((a, b))) for a in reach for b in reach[a] if a != b and a in reach.get(b, ())})
    assert not cycles, [(a, b, where.get((a, b)), where.get((b, a))) for a, b in cycles]
    assert {"gateway", "kernel", "cluster", "orchestrator"} <= set(edges), "the graph holds the package's parts"


def _reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_version_is_pyprojects():
    from openrl_lab import __version__

    assert __version__ == tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]["version"]
