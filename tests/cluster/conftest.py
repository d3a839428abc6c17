"""The `cluster` marker: tests that need a real Kubernetes cluster (none can run on this project's machines).
They run with `KUBECONFIG` and `OPENRL_TEST_K8S_NAMESPACE` set (`pytest -m cluster tests/cluster`), and are
skipped otherwise, with the reason shown by `-ra`."""

from __future__ import annotations

import os

import pytest

NEEDS = ("KUBECONFIG", "OPENRL_TEST_K8S_NAMESPACE")


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: needs a real Kubernetes cluster ($KUBECONFIG, "
                                       "$OPENRL_TEST_K8S_NAMESPACE); skipped without one")


def pytest_collection_modifyitems(config, items):
    missing = [v for v in NEEDS if not os.environ.get(v)]
    if not missing:
        return
    skip = pytest.mark.skip(reason=f"needs a real Kubernetes cluster: set {' and '.join(missing)} (an API emulator "
                                   "is all that runs here; see tests/cluster/test_kubernetes_launcher.py)")
    for item in items:
        if item.get_closest_marker("cluster") is not None:  # not `in keywords`: this folder is "cluster" too
            item.add_marker(skip)
