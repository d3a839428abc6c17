# The root conftest: loaded by every pytest run in this checkout (tests/, the tutorials under nbval, tests/vllm and
# tests/cookbook in their environments), so the harness (nothing outlives a run, the suite's deadline) is in all,
# and every test knows its tier (`fast` unless it starts something; `make test-fast`).
pytest_plugins = ["tests.harness", "tests.tiers"]
