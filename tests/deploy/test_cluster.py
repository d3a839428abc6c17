"""Against a real cluster (the one $KUBECONFIG names; skipped, saying so, without): what the offline layers cannot
check, the API server's own validation, admission and API availability (resource.k8s.io/v1 for the GPU values).
Nothing is created: server-side dry runs only. Namespace: $OPENRL_TEST_K8S_NAMESPACE."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.deploy.chart import CHART, KUBE_VERSION, VALUES_FILES, helm, tool

pytestmark = pytest.mark.cluster
NAMESPACE = os.environ.get("OPENRL_TEST_K8S_NAMESPACE", "default")


def test_the_cluster_serves_kubernetes_1_34_or_newer():
    out = subprocess.run([tool("kubectl"), "version", "-o", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    server = json.loads(out.stdout)["serverVersion"]
    assert (int(server["major"]), int(server["minor"].rstrip("+"))) >= tuple(map(int, KUBE_VERSION.split(".")[:2]))


@pytest.mark.parametrize("values", VALUES_FILES)
def test_helm_install_dry_run_server_accepts_every_values_file(values):
    helm(
        "install",
        "openrl-lab-dry-run",
        str(CHART),
        "--namespace",
        NAMESPACE,
        "-f",
        str(CHART / values),
        "--dry-run=server",
    )


@pytest.mark.parametrize("values", VALUES_FILES)
def test_rendered_manifests_pass_the_api_servers_dry_run(values):
    rendered = helm(
        "template", "openrl-lab-dry-run", str(CHART), "--namespace", NAMESPACE, "-f", str(CHART / values)
    ).stdout
    out = subprocess.run(
        [tool("kubectl"), "apply", "--dry-run=server", "--namespace", NAMESPACE, "-f", "-"],
        input=rendered,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
