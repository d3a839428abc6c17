"""The tutorials in notebooks/ stay small and clean: stored without outputs or widget state, valid nbformat,
every code cell valid (I)Python. Running them is nbval's job (see notebooks/README.md); this runs in ms."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
EXPECTED = [
    "01-quickstart",
    "02-grpo-live-plots",
    "03-time-slicing",
    "04-tinker-sdk",
    "05-checkpoints-and-resume",
    "06-own-model-code",
    "07-tinker-cookbook",
]
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_tutorials_are_there():
    assert [p.stem for p in PATHS] == EXPECTED


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_is_small_and_stored_clean(path):
    assert path.stat().st_size < 32_000, f"{path.name} is {path.stat().st_size} bytes: clear its outputs"
    raw = json.loads(path.read_text())
    nb = nbformat.reads(path.read_text(), as_version=4)
    nbformat.validate(nb)
    assert "widgets" not in raw["metadata"], f"{path.name} stores widget state"
    # The OpenRL kernel (`make install` adds it; it preloads the magics). nbval runs them anyway on this
    # interpreter's plain ipykernel (`--nbval-current-env` ignores the kernelspec), hence `%load_ext openrl_lab`.
    assert nb.metadata.kernelspec.name == "openrl", "the tutorials open on the OpenRL (Python 3) kernel"
    assert nb.metadata.kernelspec.display_name == "OpenRL (Python 3)"
    ids = [c.id for c in nb.cells]
    assert len(set(ids)) == len(ids), "cell ids are unique"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} is stored with outputs: run `jupyter nbconvert --clear-output --inplace "
                f"notebooks/*.ipynb`\n{cell.source[:200]}"
            )


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_every_code_cell_parses(path):
    nb = nbformat.read(path, as_version=4)
    transform = TransformerManager().transform_cell
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        python = transform(cell.source)  # magics become get_ipython() calls; a %% cell body is a string
        try:
            ast.parse(python)  # a top-level `await` parses (compiling it needs a kernel's flags)
        except SyntaxError as e:
            pytest.fail(f"{path.name} code cell {i}: {e}\n{cell.source}")
        if cell.source.startswith("%%openrl phase"):  # the body runs as Python too
            body = cell.source.split("\n", 1)[1]
            ast.parse(transform(body))
