"""The package's version (pyproject.toml's `version`; tests/test_layering.py checks they agree)."""

__version__ = "0.1.0"
