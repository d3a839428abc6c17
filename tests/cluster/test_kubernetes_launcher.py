"""The Kubernetes launcher's contract, against an API emulator (tests/cluster/kube_emulator.py), not a cluster.

Proved here: through the official client, over real HTTP, the launcher creates kernel Pods whose every field passes
the strict Kubernetes 1.34 schema (the emulator answers 422 otherwise) in the shape the chart's contract names;
follows them to Running through a watch; replaces one that Failed or disappeared (backing off when a slot keeps
failing, waiting for a terminating Pod to go); adopts or replaces what an earlier control plane left; deletes
them at shutdown; and makes no API request that `cluster/rbac.py` RULES (the chart's Role) does not grant.
Not proved: scheduling, admission, label-selector semantics, RBAC enforcement, DRA allocation, Kueue; the
`cluster` marker's suite runs against a real cluster for those.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import kubernetes
import pytest

from openrl_lab.cluster.kubernetes import (
    GROUP_LABEL,
    SPEC_ANNOTATION,
    KubernetesLauncher,
    LauncherConfigError,
    load_launcher_config,
)
from openrl_lab.cluster.rbac import RULES
from tests.cluster.kube_emulator import EmulatorThread, FakeKubelet

NS = "lab"
LABELS = {
    "app.kubernetes.io/name": "openrl-lab",
    "app.kubernetes.io/instance": "openrl-lab",
    "app.kubernetes.io/component": "kernel",
    "kueue.x-k8s.io/queue-name": "research",
}
CONFIG = {
    "namespace": NS,
    "image": "registry.example/openrl-lab:1.0",
    "imagePullPolicy": "IfNotPresent",
    "controlPlane": "openrl-lab-control-plane.lab.svc:50051",
    "joinTokenSecret": "openrl-lab-join-token",
    "tlsSecret": "openrl-lab-kernel-tls",
    "checkpointClaim": "openrl-lab-checkpoints",
    "podLabels": LABELS,
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "resources": {"requests": {"cpu": "2", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
    "groups": [
        {"id": "gpu0", "device": "cuda:0", "kernels": 1, "claim": {"template": "openrl-lab-gpu"}},
        {"id": "shared", "device": "cuda:0", "kernels": 2, "claim": {"shared": "openrl-lab-shared-gpu"}},
        {"id": "cpu", "kernels": 1},
    ],
}
PODS = [
    "openrl-lab-kernel-gpu0-0",
    "openrl-lab-kernel-shared-0",
    "openrl-lab-kernel-shared-1",
    "openrl-lab-kernel-cpu-0",
]


def wait_until(predicate, timeout: float = 10.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture
def emu():
    with EmulatorThread() as e:
        yield e


@pytest.fixture
def kubelet(emu):
    return FakeKubelet(emu, NS)


@pytest.fixture
def launch(emu):
    """Starts launchers against the emulator (fast backoff) and stops them at the end."""
    started: list[KubernetesLauncher] = []

    def start(config: dict | None = None, emulator: EmulatorThread | None = None, **kw) -> KubernetesLauncher:
        gone = kw.pop("gone", None)
        options = dict(resync_s=2.0, backoff_base_s=0.3, backoff_max_s=1.2, stable_s=60.0)
        options.update(kw)
        launcher = KubernetesLauncher(
            load_launcher_config(config or CONFIG),
            (emulator or emu).configuration(),
            on_kernel_gone=(lambda *a: gone.append(a)) if gone is not None else None,
            **options,
        )
        started.append(launcher)
        return launcher.start()

    yield start
    for launcher in started:
        launcher.stop()


def uids(kubelet) -> dict[str, str]:
    return {name: pod["metadata"]["uid"] for name, pod in kubelet.pods().items()}


def slot(launcher, name: str) -> dict:
    return next(s for s in launcher.status() if s["pod"] == name)


def direct_client(emu) -> kubernetes.client.CoreV1Api:
    """The test's own client (what an earlier control plane or a user did); its requests are not the launcher's."""
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(emu.configuration()))


# --- the Pods' shape ---------------------------------------------------------------------------------------
@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_one_pod_per_kernel_per_group_in_the_contracts_shape(emu, kubelet, launch):
    launch()
    pods = kubelet.pods()
    assert sorted(pods) == sorted(PODS)
    assert emu.emulator.rejected == []  # every create passed the strict 1.34 schema
    for name, pod in pods.items():
        group = name.removeprefix("openrl-lab-kernel-").rsplit("-", 1)[0]
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["namespace"] == NS and meta["labels"] == {**LABELS, GROUP_LABEL: group}
        assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
        assert spec["nodeSelector"] == CONFIG["nodeSelector"] and spec["tolerations"] == CONFIG["tolerations"]
        (c,) = spec["containers"]
        device = "cpu" if group == "cpu" else "cuda:0"
        assert c["name"] == "kernel" and c["image"] == CONFIG["image"] and c["imagePullPolicy"] == "IfNotPresent"
        assert c["command"] == [
            "openrl-lab",
            "kernel",
            "join",
            "--control-plane",
            "openrl-lab-control-plane.lab.svc:50051",
            "--token-file",
            "/var/run/openrl/join/token",
            "--device",
            device,
            "--group",
            group,
            "--name",
            name,
            "--listen",
            "0.0.0.0:7070",
            "--advertise",
            "$(POD_IP)",
            "--tls-cert",
            "/var/run/openrl/tls/tls.crt",
            "--tls-key",
            "/var/run/openrl/tls/tls.key",
            "--ca",
            "/var/run/openrl/tls/ca.crt",
            "--home",
            "/var/lib/openrl/home",
        ]
        assert c["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        assert c["ports"] == [{"name": "kernel", "containerPort": 7070, "protocol": "TCP"}]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts == {
            "join-token": "/var/run/openrl/join",
            "tls": "/var/run/openrl/tls",
            "checkpoints": "/data/checkpoints",
            "home": "/var/lib/openrl",
        }
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["join-token"]["secret"] == {
            "secretName": "openrl-lab-join-token",
            "items": [{"key": "token", "path": "token"}],
        }
        assert volumes["tls"]["secret"]["secretName"] == "openrl-lab-kernel-tls"
        assert {i["key"] for i in volumes["tls"]["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
        assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "openrl-lab-checkpoints"}
        assert volumes["home"] == {"name": "home", "emptyDir": {}}
        assert c["resources"]["requests"] == {"cpu": "2", "memory": "16Gi"}
        assert c["resources"]["limits"] == {"memory": "32Gi"}
        if group == "cpu":
            assert "resourceClaims" not in spec and "claims" not in c["resources"]
        else:
            ref = (
                {"resourceClaimTemplateName": "openrl-lab-gpu"}
                if group == "gpu0"
                else {"resourceClaimName": "openrl-lab-shared-gpu"}
            )  # one claim the group's Pods share
            assert spec["resourceClaims"] == [{"name": "gpu", **ref}]
            assert c["resources"]["claims"] == [{"name": "gpu"}]


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_the_served_models_catalog_reaches_the_kernel_pods(emu, kubelet, launch, monkeypatch):
    catalog = {"Qwen/Qwen3-8B": "/models/qwen3-8b", "acme/cached": ""}
    monkeypatch.setenv("OPENRL_LAB_MODELS", json.dumps(catalog))
    launch()
    assert emu.emulator.rejected == []
    for pod in kubelet.pods().values():
        (c,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert json.loads(env["OPENRL_LAB_MODELS"]) == catalog and "POD_IP" in env


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_a_vllm_groups_pods_join_with_the_vllm_sampler(emu, kubelet, launch):
    config = {
        **CONFIG,
        "groups": [*CONFIG["groups"][:2], {"id": "cpu", "kernels": 1, "sampler": "vllm", "samplerFallback": True}],
    }
    launch(config)
    pods = kubelet.pods()
    assert emu.emulator.rejected == []
    (c,) = pods["openrl-lab-kernel-cpu-0"]["spec"]["containers"]
    assert c["command"][:3] == ["openrl-lab", "kernel", "join"]
    assert c["command"][-3:] == ["--sampler", "vllm", "--sampler-fallback"]
    for torch_pod in ("openrl-lab-kernel-gpu0-0", "openrl-lab-kernel-shared-0"):  # as before: no sampler flags
        assert "--sampler" not in pods[torch_pod]["spec"]["containers"][0]["command"]
    specs = {g.id: g for g in load_launcher_config(config).group_specs()}
    assert (specs["cpu"].sampler, specs["cpu"].sampler_fallback, specs["gpu0"].sampler) == ("vllm", True, "torch")


def test_orchestrator_groups_come_from_launcher_json():
    specs = {g.id: g for g in load_launcher_config(CONFIG).group_specs()}
    assert list(specs) == ["gpu0", "shared", "cpu"]
    assert specs["shared"].devices == ("openrl-lab-kernel-shared-0/cuda:0", "openrl-lab-kernel-shared-1/cuda:0")
    # several groups: the first trains by default, the last samples (as for local kernels)
    assert specs["gpu0"].aliases == ("trainer-group",) and specs["cpu"].aliases == ("sampler-group",)
    one = load_launcher_config({**CONFIG, "groups": [{"id": "gpu", "device": "cuda", "claim": {"template": "t"}}]})
    assert one.group_specs()[0].aliases == ("trainer-group", "sampler-group")
    named = load_launcher_config(
        {
            **CONFIG,
            "groups": [
                {"id": "a", "device": "cuda", "claim": {"template": "t"}, "aliases": ["sampler-group"]},
                {"id": "b", "device": "cuda", "claim": {"template": "t"}},
            ],
        }
    )
    assert [g.aliases for g in named.group_specs()] == [("sampler-group",), ()]


# --- following and replacing -------------------------------------------------------------------------------
@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_watch_follows_the_pods_to_running(kubelet, launch):
    launcher = launch(resync_s=60.0)  # only the watch can tell it
    ips = {name: kubelet.run(name) for name in PODS}
    wait_until(lambda: all(s["phase"] == "Running" for s in launcher.status()), what="every Pod Running")
    assert {s["pod"]: s["ip"] for s in launcher.status()} == ips


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_a_failed_pod_is_replaced_and_its_kernel_declared_gone(kubelet, launch):
    gone: list = []
    launch(gone=gone, resync_s=60.0)
    ips = {name: kubelet.run(name) for name in PODS}
    before = uids(kubelet)
    kubelet.fail("openrl-lab-kernel-shared-1", exit_code=137, reason="OOMKilled")
    after = wait_until(
        lambda: (
            (u := uids(kubelet)).get("openrl-lab-kernel-shared-1") not in (None, before["openrl-lab-kernel-shared-1"])
            and u
        ),
        what="a new Pod in the failed one's place",
    )
    assert {n: u for n, u in after.items() if n != "openrl-lab-kernel-shared-1"} == {
        n: u for n, u in before.items() if n != "openrl-lab-kernel-shared-1"
    }  # the others untouched
    # the fleet hears it at once, with the Pod's IP (only the kernel that joined from there is lost)
    assert gone == [
        ("openrl-lab-kernel-shared-1", "its Pod failed: OOMKilled (exit code 137)", ips["openrl-lab-kernel-shared-1"])
    ]
    assert kubelet.pods()["openrl-lab-kernel-shared-1"]["status"]["phase"] == "Pending"
    # a kernel that exits by itself (Succeeded) is replaced too: the group must keep its kernels
    kubelet.run("openrl-lab-kernel-shared-1")
    kubelet.fail("openrl-lab-kernel-shared-1", exit_code=0, reason="Completed", phase="Succeeded")
    wait_until(
        lambda: (
            len(gone) == 2
            and kubelet.pods().get("openrl-lab-kernel-shared-1", {}).get("status", {}).get("phase") == "Pending"
        ),
        what="the exited Pod replaced",
    )
    assert gone[1][1] == "its Pod exited: Completed (exit code 0)"


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_a_deleted_pod_is_recreated(kubelet, launch):
    gone: list = []
    launcher = launch(gone=gone, resync_s=60.0)
    ip = kubelet.run("openrl-lab-kernel-gpu0-0")
    # The launcher can name the IP of a Pod it has seen running (under load its watch may open late: wait for it).
    wait_until(lambda: slot(launcher, "openrl-lab-kernel-gpu0-0")["ip"] == ip, what="the Pod seen running")
    before = uids(kubelet)["openrl-lab-kernel-gpu0-0"]
    kubelet.remove("openrl-lab-kernel-gpu0-0")  # kubectl delete, an eviction, a drained node
    wait_until(lambda: uids(kubelet).get("openrl-lab-kernel-gpu0-0") not in (None, before), what="recreated")
    assert gone == [("openrl-lab-kernel-gpu0-0", "its Pod disappeared (deleted or evicted)", ip)]


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_an_evicted_pod_is_replaced(kubelet, launch):
    gone: list = []
    launch(CONFIG | {"groups": [{"id": "cpu", "kernels": 1}]}, gone=gone, resync_s=60.0)
    name = "openrl-lab-kernel-cpu-0"
    ip = kubelet.run(name)
    old = uids(kubelet)[name]
    kubelet.evict(name)
    wait_until(lambda: uids(kubelet).get(name) not in (None, old), what="the evicted Pod replaced")
    assert gone == [(name, "its Pod failed: Evicted: The node was low on resource: memory.", ip)]


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_a_slot_that_keeps_failing_backs_off(kubelet, launch):
    base, cap = 1.0, 2.0  # backoffs: none, 1 s, 2 s, then capped at 2 s (uncapped it would be 4 s)
    launcher = launch(
        CONFIG | {"groups": [{"id": "cpu", "kernels": 1}]}, backoff_base_s=base, backoff_max_s=cap, resync_s=60.0
    )
    name = "openrl-lab-kernel-cpu-0"
    waits, said = [], []
    for _ in range(4):
        old = uids(kubelet)[name]
        kubelet.run(name)
        kubelet.fail(name)
        failed = time.monotonic()
        wait_until(lambda old=old: uids(kubelet).get(name) not in (None, old), what="the replacement")
        waits.append(time.monotonic() - failed)
        said.append(slot(launcher, name)["last_failure"])
    assert slot(launcher, name)["failures"] == 4 and all("failed: Error (exit code 1)" in s for s in said), said
    # The backoff the launcher chose, as it reports it: none, 1 s, 2 s, then capped at 2 s (not 4 s) ...
    assert [s.rsplit("; ", 1)[1] for s in said] == ["replaced", "replaced in 1 s", "replaced in 2 s", "replaced in 2 s"]
    # ... and kept: lower bounds on the wall time hold whatever the load (a loaded machine only adds to them; an
    # upper bound would measure the machine, not the launcher)
    assert waits[1] >= base and waits[2] >= 2 * base and waits[3] >= cap, waits


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_a_terminating_pod_is_replaced_only_once_it_is_gone():
    with EmulatorThread(graceful=True) as slow:  # Pods linger with a deletionTimestamp, as on a real node
        kubelet = FakeKubelet(slow, NS)
        config = load_launcher_config(CONFIG | {"groups": [{"id": "cpu", "kernels": 1}]})
        launcher = KubernetesLauncher(config, slow.configuration(), resync_s=0.2).start()
        try:
            name = "openrl-lab-kernel-cpu-0"
            kubelet.run(name)
            old = uids(kubelet)[name]
            kubelet.fail(name)
            wait_until(lambda: kubelet.pods()[name]["metadata"].get("deletionTimestamp"), what="the deletion")
            time.sleep(0.6)  # several passes: none tries to create a Pod under the terminating one's name
            assert uids(kubelet)[name] == old
            assert len([r for r in slow.emulator.requests_seen if r[2] == "create"]) == 1
            kubelet.remove(name)  # the node is done with it
            wait_until(lambda: uids(kubelet).get(name) not in (None, old), what="the replacement")
        finally:
            launcher.stop()


# --- start and stop ---------------------------------------------------------------------------------------
@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_shutdown_deletes_every_kernel_pod_and_nothing_else(emu, kubelet, launch):
    api = direct_client(emu)
    foreign = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "notebook", "labels": {"app": "jupyterhub"}},
        "spec": {"containers": [{"name": "nb", "image": "jupyter"}]},
    }
    api.create_namespaced_pod(NS, foreign)
    launcher = launch()
    for name in PODS:
        kubelet.run(name)
    launcher.stop()
    assert sorted(kubelet.pods()) == ["notebook"]
    time.sleep(0.3)
    assert sorted(kubelet.pods()) == ["notebook"]  # stopped: nothing comes back


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_pods_left_by_an_earlier_control_plane_are_adopted_or_replaced(emu, kubelet, launch):
    """A control plane that crashed left its Pods. Ours with this configuration's spec are kept (their kernels
    rejoin by themselves); ours with another spec (an older image) are replaced; ours no slot wants are deleted;
    Pods that are not ours are left alone."""
    api = direct_client(emu)
    config = load_launcher_config(CONFIG)
    api.create_namespaced_pod(NS, config.pod_manifest(config.groups[0], 0))  # gpu0-0, current spec
    older = load_launcher_config(CONFIG | {"image": "registry.example/openrl-lab:0.9"})
    api.create_namespaced_pod(NS, older.pod_manifest(older.groups[1], 0))  # shared-0, older image
    more = load_launcher_config(CONFIG | {"groups": [{"id": "old", "kernels": 1}]})
    api.create_namespaced_pod(NS, more.pod_manifest(more.groups[0], 0))  # a group that is no more
    other = load_launcher_config(
        CONFIG | {"namePrefix": "other", "podLabels": {**LABELS, "app.kubernetes.io/instance": "other"}}
    )
    api.create_namespaced_pod(NS, other.pod_manifest(other.groups[0], 0))  # another release's kernel
    ip = kubelet.run("openrl-lab-kernel-gpu0-0")
    before = uids(kubelet)
    emu.emulator.requests_seen.clear()
    gone: list = []
    launcher = launch(gone=gone)
    after = wait_until(
        lambda: (
            (u := uids(kubelet)).get("openrl-lab-kernel-shared-0") not in (None, before["openrl-lab-kernel-shared-0"])
            and u
        ),
        what="the older Pod replaced",
    )
    assert sorted(after) == sorted([*PODS, "other-kernel-gpu0-0"])
    assert after["openrl-lab-kernel-gpu0-0"] == before["openrl-lab-kernel-gpu0-0"]  # adopted
    assert after["other-kernel-gpu0-0"] == before["other-kernel-gpu0-0"]
    assert kubelet.pods()["openrl-lab-kernel-shared-0"]["spec"]["containers"][0]["image"] == CONFIG["image"]
    assert [g[:2] for g in gone] == [
        ("openrl-lab-kernel-shared-0", "its Pod was replaced: the kernel Pod spec changed")
    ]
    deleted = {r[5] for r in emu.emulator.requests_seen if r[2] == "delete"}
    assert deleted == {"openrl-lab-kernel-shared-0", "openrl-lab-kernel-old-0"}
    assert slot(launcher, "openrl-lab-kernel-gpu0-0")["ip"] == ip  # its kernel rejoins from there by itself


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_a_pod_name_taken_by_something_else_is_reported_not_touched(emu, kubelet, launch):
    api = direct_client(emu)
    squatter = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "openrl-lab-kernel-cpu-0"},
        "spec": {"containers": [{"name": "x", "image": "busybox"}]},
    }
    api.create_namespaced_pod(NS, squatter)
    launcher = launch(CONFIG | {"groups": [{"id": "cpu", "kernels": 1}]})
    assert "exists that is no kernel Pod of this control plane" in launcher.last_error
    s = slot(launcher, "openrl-lab-kernel-cpu-0")
    assert s["failures"] >= 1 and "namePrefix" in s["last"]
    assert kubelet.pods()["openrl-lab-kernel-cpu-0"]["spec"]["containers"][0]["image"] == "busybox"


# --- what the API server refuses ---------------------------------------------------------------------------
@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_the_emulator_refuses_what_the_api_server_would(emu):
    """The validation is live. (The official client checks its models before sending, so plain HTTP here.)"""

    def post(pod: dict) -> tuple[int, str]:
        request = urllib.request.Request(
            f"{emu.url}/api/v1/namespaces/{NS}/pods",
            json.dumps(pod).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, ""
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["message"]

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bad"},
        "spec": {
            "containers": [{"name": "c", "image": "x"}],
            "resourceClaims": [{"name": "gpu", "source": {"resourceClaimTemplateName": "t"}}],
        },
    }
    code, message = post(pod)  # the alpha-era claim reference, gone from resource.k8s.io v1
    assert code == 422 and "'source' was unexpected" in message
    code, message = post(
        {**pod, "metadata": {"name": "Bad_Name"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    )
    assert code == 422 and "RFC 1123" in message
    code, message = post({**pod, "metadata": {"name": "elsewhere", "namespace": "other"}})
    assert code == 400 and "does not match the namespace" in message
    assert post({**pod, "spec": {"containers": [{"name": "c", "image": "x"}]}})[0] in (200, 201)  # and a valid one
    assert emu.emulator.rejected[0].startswith("Pod 'bad' is invalid")


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_a_pod_the_api_server_refuses_is_reported_and_retried_with_backoff(emu, kubelet):
    config = load_launcher_config(CONFIG | {"groups": [{"id": "cpu", "kernels": 1}]})
    launcher = KubernetesLauncher(config, emu.configuration(), backoff_base_s=0.3, backoff_max_s=0.6)
    # what the client lets through and the API server refuses (a name that is no DNS subdomain)
    launcher.manifests["openrl-lab-kernel-cpu-0"]["metadata"]["name"] = "Openrl-Lab-Kernel-cpu-0"
    try:
        launcher.start()
        assert (
            "cannot create kernel Pod openrl-lab-kernel-cpu-0: Pod 'Openrl-Lab-Kernel-cpu-0' is invalid"
            in launcher.last_error
        )
        assert kubelet.pods() == {}
        wait_until(lambda: slot(launcher, "openrl-lab-kernel-cpu-0")["failures"] >= 3, what="retries")
    finally:
        launcher.stop()


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_a_service_account_that_may_not_list_pods_stops_the_start(emu):
    from openrl_lab.cluster.kubernetes import LauncherError

    emu.emulator.forbidden = True
    launcher = KubernetesLauncher(load_launcher_config(CONFIG), emu.configuration())
    with pytest.raises(
        LauncherError,
        match=r"the Kubernetes API refused to list Pods in namespace 'lab' \(403 "
        r"Forbidden\): pods is forbidden: .* cannot list resource \"pods\"",
    ):
        launcher.start()


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_serve_exits_in_one_line_when_the_kubernetes_api_is_unreachable(tmp_path):
    config = tmp_path / "launcher.json"
    config.write_text(json.dumps(CONFIG))
    port = _free_port()
    (tmp_path / "kubeconfig").write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "openrl_lab.cli",
            "serve",
            "--home",
            str(tmp_path / "home"),
            "--port",
            str(_free_port()),
            "--grpc-port",
            "0",
            "--cpu-kernels",
            "0",
            "--kernel-launcher",
            "kubernetes",
            "--launcher-config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]  # (urllib3 warns of its retries before)
    assert last.startswith(
        f"openrl-lab serve: the Kubernetes launcher cannot start: cannot reach the Kubernetes "
        f"API at http://127.0.0.1:{port}: "
    ), last


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"imagePullpolicy": "Always"}, "imagePullpolicy: unknown key (known: checkpointClaim, controlPlane"),
        (
            {"groups": [{"id": "gpu0", "device": "cuda:0", "kernel": 1}]},
            (
                "groups.0.kernel: unknown key (known: aliases, claim, device, devices, id, kernels, sampler, "
                "samplerFallback)"
            ),
        ),
        ({"groups": [{"id": "a", "sampler": "vLLM"}]}, "groups.0.sampler: unknown sampler 'vLLM' (one of torch, vllm)"),
        ({"groups": [{"id": "a", "samplerFallback": True}]}, "groups.0: samplerFallback goes with sampler vllm"),
        ({"groups": [{"id": "gpu0", "device": "cuda:0"}]}, "groups.0: device 'cuda:0' needs a claim"),
        ({"groups": [{"id": "GPU_0"}]}, "groups.0.id: group id 'GPU_0' must be 1-40 lowercase letters"),
        (
            {"groups": [{"id": "a", "device": "cuda", "claim": {"template": "t", "shared": "s"}}]},
            'names exactly one of "template"',
        ),
        ({"groups": [{"id": "a"}, {"id": "a"}]}, "group ids must be unique; used twice: a"),
        ({"groups": []}, "groups: no groups"),
        ({"resources": {"limits": {"memory": "lots"}}}, "memory: 'lots' is not a resource name and quantity"),
        ({"controlPlane": "control-plane"}, "controlPlane: address 'control-plane' is not HOST:PORT"),
        ({"podLabels": {GROUP_LABEL: "x"}}, "openrl.dev/group is set by the launcher"),
        ({"namespace": "Lab"}, "namespace 'Lab' is not a Kubernetes namespace name"),
        ({"tolerations": [{"key": "a", "operater": "Exists"}]}, "tolerations.0.operater: unknown key"),
    ],
)
def test_a_bad_launcher_json_is_refused_with_a_readable_message(change, message):
    with pytest.raises(LauncherConfigError) as e:
        load_launcher_config(CONFIG | change)
    assert message in str(e.value).replace("Value error, ", "")
    assert "\n" not in str(e.value)


@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_serve_refuses_a_bad_launcher_json_in_one_line(tmp_path):
    bad = tmp_path / "launcher.json"
    bad.write_text(json.dumps(CONFIG | {"groups": [{"id": "gpu0", "device": "cuda:0", "kernel": 1}]}))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "openrl_lab.cli",
            "serve",
            "--home",
            str(tmp_path / "home"),
            "--kernel-launcher",
            "kubernetes",
            "--launcher-config",
            str(bad),
            "--cpu-kernels",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        (
            f"openrl-lab serve: launcher config {bad}: groups.0.kernel: unknown key (known: aliases, claim, device, "
            "devices, id, kernels, sampler, samplerFallback)"
        )
    ]
    (tmp_path / "broken.json").write_text("{not json")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "openrl_lab.cli",
            "serve",
            "--home",
            str(tmp_path / "home"),
            "--kernel-launcher",
            "kubernetes",
            "--launcher-config",
            str(tmp_path / "broken.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "not JSON" in out.stderr and len(out.stderr.strip().splitlines()) == 1


# --- RBAC cross-check --------------------------------------------------------------------------------------
@pytest.mark.server  # a Kubernetes API emulator on loopback, or serve processes
def test_every_request_the_launcher_makes_is_granted_by_the_role(emu, kubelet, launch):
    """The whole life (create, watch, replace a failed and a deleted Pod, a name conflict, adopt, shutdown) with
    every request the emulator received checked against rbac.RULES, which the chart's Role renders: code, chart
    and RBAC cannot drift apart."""
    direct_client(emu).create_namespaced_pod(
        NS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "openrl-lab-kernel-shared-1", "labels": {GROUP_LABEL: "shared"}},
            "spec": {"containers": [{"name": "x", "image": "old"}]},
        },
    )  # ours by name and group label, older labels
    emu.emulator.requests_seen.clear()
    launcher = launch()
    wait_until(lambda: sorted(kubelet.pods()) == sorted(PODS), what="every Pod")  # the stale one replaced
    kubelet.run("openrl-lab-kernel-gpu0-0")
    kubelet.fail("openrl-lab-kernel-gpu0-0")
    kubelet.remove("openrl-lab-kernel-cpu-0")
    wait_until(
        lambda: (
            sorted(kubelet.pods()) == sorted(PODS)
            and kubelet.pods()["openrl-lab-kernel-gpu0-0"]["status"]["phase"] == "Pending"
        ),
        what="replacements",
    )
    launcher.stop()
    seen = emu.emulator.requests_seen
    assert {r[2] for r in seen} >= {"create", "delete", "get", "list", "watch"}  # the whole list was exercised
    for group, resource, verb, namespace, query, _ in seen:
        assert any(
            group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"] for rule in RULES
        ), f"{verb} {resource} ({group or 'core'}) is not granted by rbac.RULES"
        assert namespace == NS, f"{verb} {resource} outside the release namespace: a Role would not allow it"
        if verb in ("list", "watch"):
            assert query.get("labelSelector") == (
                "openrl.dev/group,app.kubernetes.io/name=openrl-lab,app.kubernetes.io/instance=openrl-lab"
            )


def test_the_rbac_rules_are_no_wider_than_what_the_launcher_uses():
    (rule,) = RULES
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list", "watch"]}


def test_spec_hash_changes_with_what_the_pod_runs():
    a = load_launcher_config(CONFIG)
    b = load_launcher_config(CONFIG | {"image": "registry.example/openrl-lab:1.1"})
    c = load_launcher_config(copy.deepcopy(CONFIG))
    h = [x.pod_manifest(x.groups[0], 0)["metadata"]["annotations"][SPEC_ANNOTATION] for x in (a, b, c)]
    assert h[0] != h[1] and h[0] == h[2]


# --- against a real cluster (skipped here) -----------------------------------------------------------------
@pytest.mark.cluster
def test_on_a_real_cluster_the_api_server_accepts_watches_and_deletes_the_pods():
    """$KUBECONFIG's cluster, namespace $OPENRL_TEST_K8S_NAMESPACE: the API server (its validation and admission,
    and its RBAC when KUBECONFIG holds the chart's service account) accepts the kernel Pods, the watch sees them,
    stop() deletes them. Their kernels need not start (the Secrets and the PVC may not exist there)."""
    import secrets

    from openrl_lab.cluster.kubernetes import client_configuration

    prefix = f"openrl-test-{secrets.token_hex(3)}"  # its own Pods only, whatever else runs in the namespace
    config = load_launcher_config(
        CONFIG
        | {
            "namespace": os.environ["OPENRL_TEST_K8S_NAMESPACE"],
            "namePrefix": prefix,
            "nodeSelector": {},
            "tolerations": [],
            "image": os.environ.get("OPENRL_TEST_K8S_IMAGE", CONFIG["image"]),
            "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
            "groups": [{"id": "cpu", "kernels": 2}],
        }
    )
    launcher = KubernetesLauncher(config, client_configuration())
    api = launcher.core
    try:
        launcher.start()
        names = {f"{prefix}-kernel-cpu-0", f"{prefix}-kernel-cpu-1"}
        wait_until(lambda: all(s["phase"] for s in launcher.status()), 60, "both Pods seen")
        listed = {
            p.metadata.name for p in api.list_namespaced_pod(config.namespace, label_selector=config.selector()).items
        }
        assert names <= listed
    finally:
        launcher.stop()
    wait_until(
        lambda: (
            not names
            & {
                p.metadata.name
                for p in api.list_namespaced_pod(config.namespace, label_selector=config.selector()).items
            }
        ),
        120,
        "the Pods deleted",
    )
