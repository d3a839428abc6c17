# Two commands do all the set-up on a fresh clone: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU build of torch 2.13.0 lies on our machines' disk; an open range would pull a multi-GB CUDA build.
# On a GPU box, set TORCH_SPEC to the build for your accelerator.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

demo: install
	$(PY) -m openrl_lab.cli demo

test: install
	$(PY) -m pytest -q

serve: install
	$(PY) -m openrl_lab.cli serve

bench: install
	$(PY) benchmarks/api_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache
