"""A stand-in for pytest-jupyter, for `make gpu-check` only (benchmarks/gpu_check.py puts this folder first on
PYTHONPATH where the real package is not importable, as on the device machine, which has pytest but no Jupyter).

tests/conftest.py loads `pytest_jupyter.jupyter_server` as a plugin for the server extension's tests; no CUDA test
uses its fixtures (jp_fetch, jp_ws_fetch), so an empty plugin lets `pytest -m cuda` collect with pytest alone."""
