"""Multi-device kernel Pods (issue 31, runs on several devices): a kernel group's `devices: N` makes its DRA claim
ask for N GPUs and reaches launcher.json, which tells the launcher to give the kernel OPENRL_KERNEL_DEVICES=N.
Rendered with the real helm binary and validated strictly against the Kubernetes schemas (tests/deploy/chart.py);
no API server is involved, so DRA allocation of N devices is not tested here."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.chart import FULLNAME, SCHEMA_VERSIONS, one, render, render_error, validate

pytestmark = pytest.mark.server  # helm renders the chart in a subprocess

TRAINER_2 = ("kernels.groups[0].devices=2",)  # values-gpu.yaml's trainer group on two GPUs per Pod
ONE_CPU_GROUP = ("kernels.groups[0].id=cpu0", "kernels.groups[0].kernels=1")


def launcher_groups(docs: list[dict]) -> dict[str, dict]:
    config = json.loads(one(docs, "ConfigMap", f"{FULLNAME}-launcher")["data"]["launcher.json"])
    return {g["id"]: g for g in config["groups"]}


def request(doc: dict) -> dict:
    spec = doc["spec"]["spec"] if doc["kind"] == "ResourceClaimTemplate" else doc["spec"]
    (req,) = spec["devices"]["requests"]
    return req["exactly"]


def test_a_groups_devices_make_its_claim_template_ask_for_that_many_gpus_and_validate():
    docs = render("values-gpu.yaml", sets=TRAINER_2)
    trainer = one(docs, "ResourceClaimTemplate", f"{FULLNAME}-trainer-gpu")
    assert request(trainer)["count"] == 2 and request(trainer)["allocationMode"] == "ExactCount"
    # the rest of the request is as for one GPU: the class and the product selector
    assert request(trainer)["deviceClassName"] == "gpu.nvidia.com"
    assert "NVIDIA H100 80GB HBM3" in request(trainer)["selectors"][0]["cel"]["expression"]
    sampler = one(docs, "ResourceClaimTemplate", f"{FULLNAME}-sampler-gpu")
    assert request(sampler)["count"] == 1  # a group that says nothing: one GPU, as before
    for doc in docs:
        for version in SCHEMA_VERSIONS:
            validate(doc, version)
    groups = launcher_groups(docs)
    assert groups["trainer"]["devices"] == 2 and groups["trainer"]["device"] == "cuda:0"
    assert "devices" not in groups["sampler"]  # only when > 1: one-device groups' config is unchanged


def test_a_shared_claim_of_a_multi_device_group_asks_for_that_many_gpus():
    docs = render("values-shared-gpu.yaml", sets=TRAINER_2)
    claim = one(docs, "ResourceClaim")
    assert request(claim)["count"] == 2
    assert claim["spec"]["devices"]["config"][0]["requests"] == ["gpu"]  # time-slicing config still applies
    for version in SCHEMA_VERSIONS:
        validate(claim, version)
    assert launcher_groups(docs)["shared-gpu"]["devices"] == 2


def test_devices_one_renders_exactly_what_no_devices_renders():
    def made(docs: list[dict]) -> list[dict]:  # Secrets are generated afresh on each render
        return [d for d in docs if d["kind"] != "Secret"]

    assert made(render("values-gpu.yaml", sets=("kernels.groups[0].devices=1",))) == made(render("values-gpu.yaml"))


@pytest.mark.parametrize(
    "value, message",
    [
        ("0", r"/kernels/groups/0/devices.*minimum"),
        ("65", r"/kernels/groups/0/devices.*maximum"),
        ("two", r"/kernels/groups/0/devices.*want integer"),
    ],
)
def test_the_values_schema_checks_devices(value, message):
    err = render_error("values.yaml", sets=(*ONE_CPU_GROUP, f"kernels.groups[0].devices={value}"))
    assert "values don't meet the specifications of the schema" in err
    assert re.search(message, err, re.S), err


def test_several_devices_without_a_gpu_are_refused_with_a_readable_message():
    err = render_error("values.yaml", sets=(*ONE_CPU_GROUP, "kernels.groups[0].devices=2"))
    assert 'group "cpu0" asks for 2 devices per kernel Pod but claims no GPU' in err


def _launcher_knows_devices() -> bool:
    try:
        from openrl_lab.cluster.kubernetes import Group
    except ImportError:
        return False
    return "devices" in Group.model_fields


@pytest.mark.skipif(
    not _launcher_knows_devices(),
    reason="the kernel launcher (openrl_lab/cluster/kubernetes.py) does not take a group's `devices` yet",
)
def test_the_launcher_tells_a_multi_device_kernel_pod_how_many_devices_it_has():
    """launcher.json's `devices` through the launcher's own parser: the kernel Pod's container gets
    OPENRL_KERNEL_DEVICES=N, references the N-GPU claim, and validates; a one-device group's Pod gets no such
    variable (its spec hash, so its running Pods, unchanged)."""
    from openrl_lab.cluster.kubernetes import load_launcher_config

    docs = render("values-gpu.yaml", sets=TRAINER_2)
    config = load_launcher_config(json.loads(one(docs, "ConfigMap", f"{FULLNAME}-launcher")["data"]["launcher.json"]))
    by_id = {g.id: g for g in config.groups}
    pod = config.pod_manifest(by_id["trainer"], 0)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["OPENRL_KERNEL_DEVICES"] == "2"
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": f"{FULLNAME}-trainer-gpu"}]
    for version in SCHEMA_VERSIONS:
        validate(pod, version)
    solo = config.pod_manifest(by_id["sampler"], 0)
    assert "OPENRL_KERNEL_DEVICES" not in {e["name"] for e in solo["spec"]["containers"][0]["env"]}
