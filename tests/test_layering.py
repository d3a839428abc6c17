"""The rooms stay apart: the control plane's own modules never import torch (they pass numpy arrays)."""

from __future__ import annotations

import ast
from pathlib import Path

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
    "memory.py",
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
