"""Rendering deploy/helm/openrl-lab with the real helm binary (offline) and validating what it renders against the
official Kubernetes OpenAPI schemas that kubernetes-validate ships. What this proves: the chart renders, and every
object has the shape a 1.34 (and the newest) API server's schema accepts, with no unknown fields. What it does not:
admission, defaulting, RBAC enforcement, scheduling, DRA allocation (docs/deploy.md, "What was tested")."""

from __future__ import annotations

import base64
import functools
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "openrl-lab"
VALUES_FILES = ("values.yaml", "values-gpu.yaml", "values-shared-gpu.yaml")
KUBE_VERSION = "1.34.0"  # the chart's floor (kubeVersion >= 1.34: resource.k8s.io/v1)
SCHEMA_VERSIONS = (KUBE_VERSION, kubernetes_validate.latest_version())
RELEASE, NAMESPACE = "openrl-lab", "openrl"
FULLNAME = RELEASE  # the release name contains the chart's name, so it is the objects' name prefix
CONTROL_PLANE = f"{FULLNAME}-control-plane"  # its Deployment (the sandbox has one too)
# Kinds no Kubernetes schema set knows (CRDs), each checked by hand where rendered; any other unknown kind fails.
NOT_IN_SCHEMAS = {("cert-manager.io/v1", "Certificate"), ("cert-manager.io/v1", "Issuer")}


def tools_dir() -> Path:
    """Where `make tools` (deploy/tools/install_tools.py) put helm and kubectl: $OPENRL_LAB_TOOLS, else the
    environment's tools/ (`.venv/tools`)."""
    return Path(os.environ.get("OPENRL_LAB_TOOLS") or Path(sys.prefix) / "tools")


def tool(name: str) -> str:
    path = tools_dir() / name / name
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"{path} is missing: run `make tools` (or python deploy/tools/install_tools.py DIR "
            "and set OPENRL_LAB_TOOLS=DIR)"
        )
    return str(path)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=60)
    if check and out.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    return out


@functools.cache
def _render(values: tuple[str, ...], sets: tuple[str, ...], release: str, namespace: str) -> tuple[int, str, str]:
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    for f in values:
        args += ["-f", str(CHART / f)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args, check=False)
    return out.returncode, out.stdout, out.stderr


def render(*values: str, sets: tuple[str, ...] = (), release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict]:
    """The documents `helm template` renders (values files are relative to the chart)."""
    rc, out, err = _render(values, tuple(sets), release, namespace)
    if rc:
        raise AssertionError(f"helm template {values} {sets} failed:\n{err}")
    return [d for d in yaml.safe_load_all(out) if d]


def render_error(*values: str, sets: tuple[str, ...] = ()) -> str:
    """helm's error output for values it must refuse."""
    rc, _, err = _render(values, tuple(sets), RELEASE, NAMESPACE)
    assert rc != 0, f"helm rendered {values} {sets} that it should have refused"
    return err


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def secret_data(doc: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}


def dra_request_errors(doc: dict) -> list[str]:
    """What a resource.k8s.io/v1 API server refuses in device requests and the schema lets through: each request
    has exactly one of `exactly` and `firstAvailable`."""
    spec = doc.get("spec", {})
    spec = spec.get("spec", {}) if doc["kind"] == "ResourceClaimTemplate" else spec
    return [
        f"{doc['kind']} {doc['metadata']['name']}: request {r.get('name')!r} needs exactly one of "
        "`exactly` and `firstAvailable`"
        for r in spec.get("devices", {}).get("requests", [])
        if ("exactly" in r) == ("firstAvailable" in r)
    ]


def validate(doc: dict, version: str) -> None:
    """Strict schema validation (unknown fields fail); a kind with no schema fails unless in NOT_IN_SCHEMAS."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        if (doc["apiVersion"], doc["kind"]) not in NOT_IN_SCHEMAS:
            raise AssertionError(
                f"{doc['apiVersion']} {doc['kind']} has no schema in Kubernetes {version}: an "
                "unknown kind (a CRD?) that nothing checks"
            ) from None
    if doc["apiVersion"].startswith("resource.k8s.io/"):
        errors = dra_request_errors(doc)
        assert not errors, errors
