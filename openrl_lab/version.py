"""The package's version (pyproject.toml's `version`; tests/test_layering.py checks they agree)."""

__version__ = "0.1.0"

# The tinker SDK versions the suite drives the lab with (tests/gateway/test_sdk_versions.py: the Makefile's
# SDK_VERSIONS, plus the project's own pin in pyproject.toml, last); the doctor compares a client's against them.
TESTED_SDKS = ("0.18.1", "0.24.1", "0.25.0", "0.38.0")
