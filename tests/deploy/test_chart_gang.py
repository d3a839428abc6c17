"""Multi-device kernel Pods (issue 31, runs on several devices): a kernel group's `devices: N` makes its DRA claim
ask for N GPUs and reaches launcher.json, whose launcher runs `kernel join --devices N` in the Pod (a kernel per
device, each in a group of its own) and lets kernel Pods reach each other (a gang's ranks talk directly).
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


def test_the_launcher_runs_a_kernel_per_device_in_a_multi_device_kernel_pod():
    """launcher.json's `devices` through the launcher's own parser: the kernel Pod's container runs
    `kernel join ... --devices N` and exposes a port per kernel (7070 + i), references the N-GPU claim, and
    validates; the orchestrator knows a group per device. A one-device group's Pod has neither (its spec hash,
    so its running Pods, unchanged)."""
    from openrl_lab.cluster.kubernetes import KERNEL_PORT, load_launcher_config

    docs = render("values-gpu.yaml", sets=TRAINER_2)
    config = load_launcher_config(json.loads(one(docs, "ConfigMap", f"{FULLNAME}-launcher")["data"]["launcher.json"]))
    by_id = {g.id: g for g in config.groups}
    pod = config.pod_manifest(by_id["trainer"], 0)
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--devices") + 1] == "2"
    assert command[command.index("--device") + 1] == "cuda:0"  # the first; kernel i counts on from it
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [
        ("kernel", KERNEL_PORT),
        ("kernel-1", KERNEL_PORT + 1),
    ]
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": f"{FULLNAME}-trainer-gpu"}]
    for version in SCHEMA_VERSIONS:
        validate(pod, version)
    name = pod["metadata"]["name"]
    assert config.kernel_names(by_id["trainer"], name) == [f"{name}-0", f"{name}-1"]
    specs = {s.id: s for s in config.group_specs()}
    assert specs["trainer-1"].devices == (f"{name}/cuda:1",) and specs["trainer"].devices == (f"{name}/cuda:0",)
    assert "trainer-group" in specs["trainer"].aliases and not specs["trainer-1"].aliases
    # the same group on one device: the Pod of before, without the argument and the second port
    one_device = config.pod_manifest(by_id["trainer"].model_copy(update={"devices": 1}), 0)
    (solo,) = one_device["spec"]["containers"]
    assert "--devices" not in solo["command"] and command == [*solo["command"], "--devices", "2"]
    assert solo["ports"] == container["ports"][:1]
    assert one_device["metadata"]["annotations"] != pod["metadata"]["annotations"]
    sampler = config.pod_manifest(by_id["sampler"], 0)
    assert "--devices" not in sampler["spec"]["containers"][0]["command"]
    assert len(sampler["spec"]["containers"][0]["ports"]) == 1
    assert config.kernel_names(by_id["sampler"], "p") == ["p"]


def test_the_launcher_refuses_what_a_multi_device_group_cannot_be():
    from openrl_lab.cluster.kubernetes import LauncherConfigError, load_launcher_config

    docs = render("values-gpu.yaml", sets=TRAINER_2)
    config = json.loads(one(docs, "ConfigMap", f"{FULLNAME}-launcher")["data"]["launcher.json"])
    clash = {**config, "groups": [*config["groups"], {"id": "trainer-1", "kernels": 1}]}
    with pytest.raises(LauncherConfigError, match="trainer-1 is a group id already"):
        load_launcher_config(clash)
    cpu = {**config, "groups": [{"id": "cpu0", "kernels": 1, "devices": 2}]}
    with pytest.raises(LauncherConfigError, match="asks for 2 devices per kernel Pod but claims no GPU"):
        load_launcher_config(cpu)
    for bad in (0, 65):
        with pytest.raises(LauncherConfigError, match="devices"):
            load_launcher_config({**config, "groups": [{**config["groups"][0], "devices": bad}]})


def test_kernel_pods_reach_each_other_and_the_control_plane_reaches_every_kernel_of_a_pod():
    """A gang's ranks in different kernel Pods talk directly (rendezvous, gloo/NCCL on random ports): kernel Pods
    take TCP from the release's kernel Pods, on any port, and from nobody else by that policy; the control plane
    reaches kernel i of a multi-device Pod on 7070 + i. Both validate strictly."""
    from openrl_lab.cluster.kubernetes import load_launcher_config

    def selects(selector: dict, labels: dict) -> bool:
        return selector["matchLabels"].items() <= labels.items()

    for sets, last_port in (((), None), (TRAINER_2, 7071)):
        docs = render("values-gpu.yaml", sets=sets)
        config = load_launcher_config(
            json.loads(one(docs, "ConfigMap", f"{FULLNAME}-launcher")["data"]["launcher.json"])
        )
        cp_labels = one(docs, "Deployment", f"{FULLNAME}-control-plane")["spec"]["template"]["metadata"]["labels"]
        pods = [config.pod_manifest(g, i) for g in config.groups for i in range(g.kernels)]
        peers = one(docs, "NetworkPolicy", f"{FULLNAME}-kernel-peers")
        kernels = one(docs, "NetworkPolicy", f"{FULLNAME}-kernels")
        for policy in (peers, kernels):
            for version in SCHEMA_VERSIONS:
                validate(policy, version)
        (rule,) = peers["spec"]["ingress"]
        (peer,) = rule["from"]
        assert rule["ports"] == [{"protocol": "TCP"}] and set(peer) == {"podSelector"}
        for pod in pods:
            labels = pod["metadata"]["labels"]
            assert selects(peers["spec"]["podSelector"], labels) and selects(peer["podSelector"], labels)
        assert not selects(peer["podSelector"], cp_labels) and not selects(peers["spec"]["podSelector"], cp_labels)
        (port,) = kernels["spec"]["ingress"][0]["ports"]
        assert port["port"] == 7070 and port.get("endPort") == last_port
        # every port a kernel Pod exposes is open to the control plane
        for pod in pods:
            for p in pod["spec"]["containers"][0]["ports"]:
                assert 7070 <= p["containerPort"] <= (last_port or 7070)
