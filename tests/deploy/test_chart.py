"""The Helm chart, offline: helm lint and helm template (the real helm binary), every rendered object validated
strictly against the Kubernetes 1.34 and newest schemas, and the chart checked against what the code expects of it
(RBAC rules, launcher.json, the serve command, secrets the control plane accepts). No API server is involved:
see chart.py for what that does and does not prove."""

from __future__ import annotations

import copy
import json
import re
import socket
import ssl
import threading

import pytest
import yaml

from openrl_lab import cli
from openrl_lab.cluster.rbac import RULES
from openrl_lab.gateway.store import Store
from openrl_lab.identity import GIVEN_API_KEY, GIVEN_JOIN_TOKEN
from tests.deploy.chart import (
    CHART,
    CONTROL_PLANE,
    FULLNAME,
    NAMESPACE,
    RELEASE,
    SCHEMA_VERSIONS,
    VALUES_FILES,
    dra_request_errors,
    helm,
    one,
    render,
    render_error,
    secret_data,
    validate,
)

# Values beyond the three files that switch templates on or off: each is rendered and validated too.
VARIANTS = {
    "cert-manager, own CA": ("values.yaml",),
    "cert-manager, given issuer": ("values.yaml",),
    "existing secrets": ("values.yaml",),
    "hub in another namespace": ("values.yaml",),
    "kueue, no network policies": ("values-gpu.yaml",),
    "vllm sampler": ("values.yaml",),
    "sandbox on the default runtime": ("values.yaml",),
    "no sandbox Pods": ("values.yaml",),
}
VARIANT_SETS = {
    "cert-manager, own CA": ("tls.mode=certManager",),
    "cert-manager, given issuer": (
        "tls.mode=certManager",
        "tls.certManager.issuerRef.name=corp-ca",
        "tls.certManager.issuerRef.kind=ClusterIssuer",
    ),
    "existing secrets": (
        "tls.mode=existing",
        "tls.existing.controlPlaneSecret=cp-tls",
        "tls.existing.kernelSecret=k-tls",
        "apiKeys.existingSecret=my-keys",
        "joinToken.existingSecret=my-token",
        "persistence.state.existingClaim=my-state",
        "persistence.checkpoints.existingClaim=my-ckpt",
        "sandbox.token.existingSecret=my-sandbox-token",
    ),
    "hub in another namespace": ("hub.namespace=hub",),
    "kueue, no network policies": ("kueue.queueName=gpu-queue", "networkPolicy.enabled=false"),
    "vllm sampler": (
        "kernels.groups[0].id=cpu0",
        "kernels.groups[0].kernels=1",
        "kernels.groups[0].sampler=vllm",
        "kernels.groups[0].samplerFallback=true",
    ),
    "sandbox on the default runtime": ("sandbox.runtimeClassName=",),
    "no sandbox Pods": ("sandbox.enabled=false",),
}
RENDERINGS = [(f, ()) for f in VALUES_FILES] + [(VARIANTS[k][0], VARIANT_SETS[k]) for k in VARIANTS]
RENDERING_IDS = list(VALUES_FILES) + list(VARIANTS)


def container(docs: list[dict]) -> dict:
    deployment = one(docs, "Deployment", f"{FULLNAME}-control-plane")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def launcher_config(docs: list[dict]) -> dict:
    return json.loads(one(docs, "ConfigMap", f"{FULLNAME}-launcher")["data"]["launcher.json"])


# --- helm itself ------------------------------------------------------------------------------------------------
@pytest.mark.server  # helm renders the chart in a subprocess
@pytest.mark.parametrize("values", VALUES_FILES)
def test_helm_lint_strict_passes_for_every_values_file(values):
    out = helm("lint", "--strict", str(CHART), "-f", str(CHART / values), "--kube-version", "1.34.0")
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.server  # helm renders the chart in a subprocess
def test_the_chart_refuses_kubernetes_older_than_1_34():
    out = helm("template", RELEASE, str(CHART), "--kube-version", "1.33.0", check=False)
    assert out.returncode != 0 and "kubeVersion" in out.stderr


# --- every rendered object against the official schemas ----------------------------------------------------------
@pytest.mark.server  # helm renders the chart in a subprocess
@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("values,sets", RENDERINGS, ids=RENDERING_IDS)
def test_rendered_manifests_validate_strictly_against_k8s_schemas(values, sets, version):
    docs = render(values, sets=sets)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Role", "RoleBinding", "ServiceAccount", "ConfigMap"} <= kinds
    for doc in docs:
        validate(doc, version)


@pytest.mark.server  # helm renders the chart in a subprocess
def test_validation_refuses_a_v1beta1_shaped_dra_request_under_v1():
    template = one(render("values-gpu.yaml"), "ResourceClaimTemplate", f"{FULLNAME}-trainer-gpu")
    old = copy.deepcopy(template)
    request = old["spec"]["spec"]["devices"]["requests"][0]
    exactly = request.pop("exactly")
    request.update(deviceClassName=exactly["deviceClassName"], count=1)  # deviceClassName on the request itself
    for version in SCHEMA_VERSIONS:
        validate(template, version)
        with pytest.raises(Exception, match="deviceClassName"):
            validate(old, version)


@pytest.mark.server  # helm renders the chart in a subprocess
def test_validation_refuses_selectors_outside_exactly_and_a_request_without_exactly():
    template = one(render("values-gpu.yaml"), "ResourceClaimTemplate", f"{FULLNAME}-trainer-gpu")
    beside = copy.deepcopy(template)
    request = beside["spec"]["spec"]["devices"]["requests"][0]
    request["selectors"] = request["exactly"].pop("selectors")
    bare = copy.deepcopy(template)
    del bare["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    for version in SCHEMA_VERSIONS:
        with pytest.raises(Exception, match="'selectors' was unexpected"):
            validate(beside, version)
        # the schema lets a request with neither `exactly` nor `firstAvailable` through; the API server (and
        # dra_request_errors) does not
        with pytest.raises(AssertionError, match="needs exactly one of `exactly` and `firstAvailable`"):
            validate(bare, version)
    assert dra_request_errors(template) == []


@pytest.mark.server  # helm renders the chart in a subprocess
def test_validation_refuses_unknown_fields_and_unknown_kinds():
    deployment = copy.deepcopy(one(render("values.yaml"), "Deployment", CONTROL_PLANE))
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # a typo of `resources`
    with pytest.raises(Exception, match="'resource' was unexpected"):
        validate(deployment, SCHEMA_VERSIONS[0])
    queue = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue", "metadata": {"name": "q"}, "spec": {}}
    with pytest.raises(AssertionError, match="unknown kind"):
        validate(queue, SCHEMA_VERSIONS[0])


# --- values.schema.json -------------------------------------------------------------------------------------------
@pytest.mark.server  # helm renders the chart in a subprocess
@pytest.mark.parametrize(
    "sets,message",
    [
        (("kernels.groups[0].id=GPU_0",), r"/kernels/groups/0/id.*GPU_0.*does not match pattern"),
        (("kernels.groups[0].kernels=0",), r"/kernels/groups/0/kernels.*minimum"),
        (("kernels.groups[0].gpu.shared=true",), r"/kernels/groups/0/gpu.*deviceClassName"),
        (
            ("kernels.groups[0].gpu.deviceClassName=gpu.nvidia.com", "kernels.groups[0].gpu.timeSlicing=Sometimes"),
            r"/kernels/groups/0/gpu/timeSlicing.*Default.*Long",
        ),
        (("tls.mode=letsencrypt",), r"/tls/mode.*generate.*certManager.*existing"),
        (("tls.mode=existing",), r"/tls/existing.*controlPlaneSecret"),
        (("joinToken.value=changeme",), r"/joinToken/value.*changeme.*does not match pattern"),
        (("apiKeys.users={alice,a@b}",), r"/apiKeys/users/1.*a@b.*does not match pattern"),
        (("persistence.checkpoints.accessMode=ReadWriteSometimes",), r"/persistence/checkpoints/accessMode"),
        (("replicas=2",), r"additional properties 'replicas' not allowed"),
    ],
)
def test_values_schema_rejects_invalid_values_with_a_readable_message(sets, message):
    err = render_error("values.yaml", sets=sets)
    assert "values don't meet the specifications of the schema" in err
    assert re.search(message, err, re.S), err


@pytest.mark.server  # helm renders the chart in a subprocess
def test_duplicate_group_ids_and_too_long_pod_names_are_refused_with_a_readable_message():
    err = render_error("values.yaml", sets=("kernels.groups[1].id=cpu0", "kernels.groups[1].kernels=1"))
    assert 'the group id "cpu0" is used twice' in err
    long_release = "a-release-name-of-forty-four-characters-long"
    out = helm(
        "template",
        long_release,
        str(CHART),
        "--kube-version",
        "1.34.0",
        "--set",
        "kernels.groups[0].id=twenty-characters-id",
        "--set",
        "kernels.groups[0].kernels=1",
        check=False,
    )
    assert out.returncode != 0
    assert f'kernel Pod name "{long_release}-kernel-twenty-characters-id-0"' in out.stderr
    assert "is longer than 63 characters" in out.stderr


# --- the chart against what the code expects ----------------------------------------------------------------------
@pytest.mark.server  # helm renders the chart in a subprocess
@pytest.mark.parametrize("values", VALUES_FILES)
def test_the_role_grants_exactly_the_launchers_rbac_rules(values):
    docs = render(values)
    role = one(docs, "Role")
    assert role["rules"] == [dict(r) for r in RULES]
    binding = one(docs, "RoleBinding")
    sa = one(docs, "ServiceAccount", CONTROL_PLANE)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    pod = one(docs, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert [d["kind"] for d in docs].count("Role") == 1 and "ClusterRole" not in {d["kind"] for d in docs}


CONTRACT_KEYS = {
    "namespace",
    "image",
    "imagePullPolicy",
    "controlPlane",
    "joinTokenSecret",
    "tlsSecret",
    "checkpointClaim",
    "podLabels",
    "nodeSelector",
    "tolerations",
    "resources",
    "groups",
}


@pytest.mark.server  # helm renders the chart in a subprocess
@pytest.mark.parametrize("values,sets", RENDERINGS, ids=RENDERING_IDS)
def test_launcher_config_is_json_with_the_contract_keys_naming_rendered_objects(values, sets):
    docs = render(values, sets=sets)
    config = launcher_config(docs)
    assert set(config) == CONTRACT_KEYS
    assert config["namespace"] == NAMESPACE
    service = one(docs, "Service", CONTROL_PLANE)
    assert config["controlPlane"] == f"{service['metadata']['name']}.{NAMESPACE}.svc:50051"
    assert 50051 in [p["port"] for p in service["spec"]["ports"]]
    assert config["image"] == container(docs)["image"]
    labels = config["podLabels"]
    assert labels["app.kubernetes.io/name"] == "openrl-lab" and labels["app.kubernetes.io/component"] == "kernel"
    assert labels["app.kubernetes.io/instance"] == RELEASE
    assert labels.get("kueue.x-k8s.io/queue-name") == ("gpu-queue" if "kueue.queueName=gpu-queue" in sets else None)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    given = dict(s.split("=", 1) for s in sets)
    # the Secrets and the claim it names are rendered here (a cert-manager Certificate makes its Secret), or are
    # the ones the values say exist
    issued = {("Secret", d["spec"]["secretName"]) for d in docs if d["kind"] == "Certificate"}
    for key, kind, value in (
        ("joinTokenSecret", "Secret", "joinToken.existingSecret"),
        ("tlsSecret", "Secret", "tls.existing.kernelSecret"),
        ("checkpointClaim", "PersistentVolumeClaim", "persistence.checkpoints.existingClaim"),
    ):
        assert config[key] == given.get(value) or (kind, config[key]) in names | issued, key
    for group in config["groups"]:
        assert set(group) <= {"id", "device", "kernels", "claim", "sampler", "samplerFallback"}
        assert isinstance(group["kernels"], int)
        claim = group.get("claim")
        if claim is None:
            assert group["device"] == "cpu"
            continue
        assert group["device"] == "cuda:0" and len(claim) == 1
        kind = {"template": "ResourceClaimTemplate", "shared": "ResourceClaim"}[next(iter(claim))]
        assert (kind, next(iter(claim.values()))) in names


@pytest.mark.server  # helm renders the chart in a subprocess
def test_the_kernel_launcher_accepts_every_rendered_launcher_config_and_its_pods_validate():
    """The launcher's own parser (openrl_lab/cluster/kubernetes.py) on each launcher.json the chart renders, and the
    kernel Pods it would create: schema-valid, selected by the kernels' NetworkPolicy, referencing rendered claims."""
    launcher = pytest.importorskip(
        "openrl_lab.cluster.kubernetes",
        reason="the kernel launcher (openrl_lab/cluster/kubernetes.py) is not in this tree",
    )
    for values, sets in RENDERINGS:
        docs = render(values, sets=sets)
        config = launcher.load_launcher_config(launcher_config(docs))
        names = {(d["kind"], d["metadata"]["name"]) for d in docs}
        policies = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-kernels")]
        for group in config.groups:
            for i in range(group.kernels):
                pod = config.pod_manifest(group, i)
                for version in SCHEMA_VERSIONS:
                    validate(pod, version)
                for policy in policies:
                    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
                for claim in pod["spec"].get("resourceClaims", []):
                    ref = claim.get("resourceClaimTemplateName") or claim["resourceClaimName"]
                    kind = "ResourceClaimTemplate" if "resourceClaimTemplateName" in claim else "ResourceClaim"
                    assert (kind, ref) in names


@pytest.mark.server  # helm renders the chart in a subprocess
def test_a_groups_sampler_reaches_launcher_json_and_its_pods_join_command():
    sets = VARIANT_SETS["vllm sampler"]
    (group,) = launcher_config(render("values.yaml", sets=sets))["groups"]
    assert group == {"id": "cpu0", "kernels": 1, "device": "cpu", "sampler": "vllm", "samplerFallback": True}
    assert [set(g) for g in launcher_config(render("values-gpu.yaml"))["groups"]] == [
        {"id", "kernels", "device", "claim"}
    ] * 2  # unset: not rendered (the launcher's default, torch)
    launcher = pytest.importorskip("openrl_lab.cluster.kubernetes")
    config = launcher.load_launcher_config(launcher_config(render("values.yaml", sets=sets)))
    command = config.pod_manifest(config.groups[0], 0)["spec"]["containers"][0]["command"]
    assert command[-3:] == ["--sampler", "vllm", "--sampler-fallback"]
    assert "must be one of" in render_error(
        "values.yaml",
        sets=("kernels.groups[0].id=cpu0", "kernels.groups[0].kernels=1", "kernels.groups[0].sampler=vllm-cpu"),
    )


@pytest.mark.server  # helm renders the chart in a subprocess
def test_each_gpu_group_gets_its_own_claim_template_and_a_shared_group_one_claim():
    gpu = launcher_config(render("values-gpu.yaml"))["groups"]
    assert [(g["id"], g["claim"]) for g in gpu] == [
        ("trainer", {"template": f"{FULLNAME}-trainer-gpu"}),
        ("sampler", {"template": f"{FULLNAME}-sampler-gpu"}),
    ]
    docs = render("values-shared-gpu.yaml")
    (shared,) = launcher_config(docs)["groups"]
    assert shared["kernels"] == 3 and shared["claim"] == {"shared": f"{FULLNAME}-shared-gpu-gpu"}
    claim = one(docs, "ResourceClaim")
    assert "ResourceClaimTemplate" not in {d["kind"] for d in docs}
    assert claim["spec"]["devices"]["requests"][0]["exactly"] == {
        "deviceClassName": "gpu.nvidia.com",
        "allocationMode": "ExactCount",
        "count": 1,
    }
    assert claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"] == {
        "strategy": "TimeSlicing",
        "timeSlicingConfig": {"interval": "Long"},
    }
    trainer = one(render("values-gpu.yaml"), "ResourceClaimTemplate", f"{FULLNAME}-trainer-gpu")
    (selector,) = trainer["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    assert selector["cel"]["expression"] == 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H100 80GB HBM3"'


# The control plane's command in the contract (K8S contract, item 2); the chart adds the Secrets it registers.
CONTRACT_SERVE = {
    "home": "/data/home",
    "host": "0.0.0.0",
    "port": "8000",
    "grpc-port": "50051",
    "cpu-kernels": "0",
    "checkpoint-store": "/data/checkpoints",
    "tls-cert": "/etc/openrl/tls/tls.crt",
    "tls-key": "/etc/openrl/tls/tls.key",
    "kernel-ca": "/etc/openrl/tls/ca.crt",
    "kernel-tls-name": "openrl-kernel",
    "kernel-launcher": "kubernetes",
    "launcher-config": "/etc/openrl/launcher/launcher.json",
}
CHART_SERVE = {"join-token-file": "/etc/openrl/join/token", "api-keys-dir": "/etc/openrl/api-keys"}
LAUNCHER_OPTIONS = {"--kernel-launcher", "--launcher-config"}  # the kernel launcher's change adds these to serve


@pytest.mark.server  # helm renders the chart in a subprocess
def test_the_control_plane_runs_the_contracts_serve_command_and_the_cli_accepts_it(monkeypatch):
    docs = render("values-gpu.yaml")
    c = container(docs)
    assert c["command"][:2] == ["openrl-lab", "serve"]
    options = dict(a.removeprefix("--").split("=", 1) for a in c["command"][2:])
    assert options == CONTRACT_SERVE | CHART_SERVE
    parsed = {}
    monkeypatch.setattr(cli, "_serve", lambda args: parsed.update(vars(args)))
    try:
        cli.main(c["command"][1:])
    except SystemExit:  # before the launcher's change: every other option must be accepted
        cli.main([a for a in c["command"][1:] if a.split("=")[0] not in LAUNCHER_OPTIONS])
    assert str(parsed["join_token_file"]) == CHART_SERVE["join-token-file"] and parsed["cpu_kernels"] == 0
    # every file it names is mounted from the object that holds it
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in one(docs, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]["volumes"]}
    for path in (
        "/etc/openrl/tls/tls.crt",
        "/etc/openrl/launcher/launcher.json",
        "/etc/openrl/join/token",
        "/etc/openrl/api-keys",
        "/data/home",
        "/data/checkpoints",
    ):
        mount = max((m for m in mounts if path == m or path.startswith(m + "/")), key=len)
        assert mount in mounts, path
    assert volumes["launcher"]["configMap"]["name"] == f"{FULLNAME}-launcher"
    assert volumes["tls"]["secret"]["secretName"] == f"{FULLNAME}-control-plane-tls"
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == launcher_config(docs)["checkpointClaim"]
    assert volumes["join-token"]["secret"]["secretName"] == launcher_config(docs)["joinTokenSecret"]
    deployment = one(docs, "Deployment", CONTROL_PLANE)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8000" and annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.server  # helm renders the chart in a subprocess
def test_generated_secrets_are_ones_the_control_plane_accepts(tmp_path):
    docs = render("values.yaml")
    token = secret_data(one(docs, "Secret", f"{FULLNAME}-join-token"))["token"]
    keys = secret_data(one(docs, "Secret", f"{FULLNAME}-api-keys"))
    assert GIVEN_JOIN_TOKEN.fullmatch(token) and set(keys) == {"alice", "bob"}
    assert all(GIVEN_API_KEY.fullmatch(k) for k in keys.values()) and len(set(keys.values())) == 2
    store = Store(tmp_path / "state.db")  # what `serve --join-token-file / --api-keys-dir` does with them
    store.set_join_token("join-token-file", token)
    store.set_keys("api-keys-dir", keys)
    assert store.user_for_key(keys["alice"]) == "alice" and store.user_for_key(keys["bob"]) == "bob"
    store.close()
    given = "orl-join-" + "x" * 40
    assert (
        secret_data(one(render("values.yaml", sets=(f"joinToken.value={given}",)), "Secret", f"{FULLNAME}-join-token"))[
            "token"
        ]
        == given
    )


@pytest.mark.server  # helm renders the chart in a subprocess
def test_hub_in_another_namespace_gets_a_copy_of_the_keys_and_is_selected_by_namespace():
    docs = render("values.yaml", sets=VARIANT_SETS["hub in another namespace"])
    copies = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{FULLNAME}-api-keys"]
    assert sorted(d["metadata"]["namespace"] for d in copies) == ["hub", NAMESPACE]
    assert secret_data(copies[0]) == secret_data(copies[1])
    policy = one(docs, "NetworkPolicy", f"{FULLNAME}-control-plane")
    hub_peer = policy["spec"]["ingress"][1]["from"][0]
    assert hub_peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "hub"}}


@pytest.mark.server  # helm renders the chart in a subprocess
def test_network_policies_let_only_the_control_plane_reach_kernels_and_only_kernels_and_hub_users_reach_it():
    docs = render("values-gpu.yaml")
    config = launcher_config(docs)
    cp_labels = one(docs, "Deployment", CONTROL_PLANE)["spec"]["template"]["metadata"]["labels"]
    kernels = one(docs, "NetworkPolicy", f"{FULLNAME}-kernels")["spec"]
    cp = one(docs, "NetworkPolicy", f"{FULLNAME}-control-plane")["spec"]

    def selects(selector: dict, labels: dict) -> bool:
        return selector["matchLabels"].items() <= labels.items()

    # kernel Pods (labelled from launcher.json) are selected, and only the control plane's Pod may reach 7070
    assert selects(kernels["podSelector"], config["podLabels"]) and kernels["policyTypes"] == ["Ingress"]
    (rule,) = kernels["ingress"]
    assert [p["port"] for p in rule["ports"]] == [7070]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"} and selects(peer["podSelector"], cp_labels)
    assert not selects(peer["podSelector"], config["podLabels"])
    # the control plane: kernels on 50051, hub user servers on 8000, nobody else
    assert selects(cp["podSelector"], cp_labels) and not selects(cp["podSelector"], config["podLabels"])
    by_port = {tuple(p["port"] for p in r["ports"]): r["from"] for r in cp["ingress"]}
    assert set(by_port) == {(50051,), (8000,)}
    assert [selects(p["podSelector"], config["podLabels"]) for p in by_port[(50051,)]] == [True]
    (hub_peer,) = by_port[(8000,)]
    assert hub_peer["podSelector"]["matchLabels"] == {
        "component": "singleuser-server",
        "app.kubernetes.io/name": "jupyterhub",
    }


@pytest.mark.server  # helm renders the chart in a subprocess
def test_generated_tls_certificates_carry_the_service_name_and_complete_a_handshake(tmp_path):
    """The generated control-plane certificate serves TLS for the name kernels dial (launcher.json's controlPlane),
    verified by the kernels' ca.crt; the kernel certificate for openrl-kernel, verified by the control plane's."""
    docs = render("values.yaml")
    host = launcher_config(docs)["controlPlane"].rsplit(":", 1)[0]
    cp = secret_data(one(docs, "Secret", f"{FULLNAME}-control-plane-tls"))
    kernel = secret_data(one(docs, "Secret", f"{FULLNAME}-kernel-tls"))
    for server, client_ca, name in ((cp, kernel["ca.crt"], host), (kernel, cp["ca.crt"], "openrl-kernel")):
        for part in ("tls.crt", "tls.key"):
            (tmp_path / part).write_text(server[part])
        (tmp_path / "ca.crt").write_text(client_ca)
        _handshake(tmp_path, name)
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(tmp_path, "someone-else")


def _handshake(pki, name: str) -> None:
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(pki / "tls.crt", pki / "tls.key")
    client_ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve():
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        with (
            socket.create_connection(listener.getsockname(), timeout=10) as raw,
            client_ctx.wrap_socket(raw, server_hostname=name) as tls,
        ):
            tls.sendall(b"x")
        t.join(10)


@pytest.mark.server  # helm renders the chart in a subprocess
def test_cert_manager_mode_issues_both_certificates_with_the_names_the_launcher_uses():
    docs = render("values.yaml", sets=VARIANT_SETS["cert-manager, own CA"])
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-tls")]
    cp = one(docs, "Certificate", f"{FULLNAME}-control-plane-tls")
    kernel = one(docs, "Certificate", launcher_config(docs)["tlsSecret"])
    assert launcher_config(docs)["controlPlane"].rsplit(":", 1)[0] in cp["spec"]["dnsNames"]
    assert kernel["spec"]["dnsNames"] == ["openrl-kernel"]
    ca_issuer = one(docs, "Issuer", f"{FULLNAME}-ca")
    assert cp["spec"]["issuerRef"]["name"] == ca_issuer["metadata"]["name"] == kernel["spec"]["issuerRef"]["name"]
    assert one(docs, "Certificate", f"{FULLNAME}-ca")["spec"]["isCA"] is True
    given = render("values.yaml", sets=VARIANT_SETS["cert-manager, given issuer"])
    assert "Issuer" not in {d["kind"] for d in given}
    assert one(given, "Certificate", f"{FULLNAME}-kernel-tls")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
    }


@pytest.mark.server  # helm renders the chart in a subprocess
def test_existing_secrets_mode_renders_no_secrets_and_no_claims():
    docs = render("values.yaml", sets=VARIANT_SETS["existing secrets"])
    assert "Secret" not in {d["kind"] for d in docs} and "PersistentVolumeClaim" not in {d["kind"] for d in docs}
    volumes = {v["name"]: v for v in one(docs, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "cp-tls"
    assert volumes["api-keys"]["secret"]["secretName"] == "my-keys"
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == "my-state"
    assert volumes["sandbox-token"]["secret"]["secretName"] == "my-sandbox-token"
    sandbox = one(docs, "Deployment", SANDBOX)["spec"]["template"]["spec"]
    assert {v["name"]: v for v in sandbox["volumes"]}["token"]["secret"]["secretName"] == "my-sandbox-token"


def test_values_files_parse_and_the_schema_is_json():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    for values in VALUES_FILES:
        assert yaml.safe_load((CHART / values).read_text())["kernels"]["groups"]


# --- the sandbox Pods (model-written code) ----------------------------------------------------------------------
# What is checked here is the rendered objects: that gVisor really runs the Pods, that the NetworkPolicy is
# enforced and that no token reaches the container need a cluster (with gVisor and a policy-enforcing CNI), which
# cannot run here (chart.py).
SANDBOX = f"{FULLNAME}-sandbox"


def sandbox_pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment", SANDBOX)["spec"]["template"]["spec"]


@pytest.mark.server  # helm renders the chart in a subprocess
def test_sandbox_pods_run_under_gvisor_by_default_with_no_token_and_a_locked_down_container(monkeypatch):
    docs = render("values.yaml")
    pod = sandbox_pod(docs)
    assert pod["runtimeClassName"] == "gvisor"
    assert "runtimeClassName" not in sandbox_pod(render("values.yaml", sets=("sandbox.runtimeClassName=",)))
    # no API credentials: the token is not mounted, and the ServiceAccount is its own, bound to nothing
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == SANDBOX
    assert one(docs, "ServiceAccount", SANDBOX)["automountServiceAccountToken"] is False
    assert not any(
        s.get("name") == SANDBOX
        for d in docs
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for s in d["subjects"]
    )
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    (c,) = pod["containers"]
    assert c["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    # the scratch: in memory, bounded, and the only writable mount
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["scratch"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    writable = [m for m in c["volumeMounts"] if not m.get("readOnly")]
    assert [m["name"] for m in writable] == ["scratch"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["OPENRL_SANDBOX_ISOLATION"] == "pod" and env["OPENRL_SANDBOX_SCRATCH_DIR"] == writable[0]["mountPath"]
    # the command is one the CLI takes, serving on the Service's port with the token the Secret mounts
    assert c["command"][:3] == ["openrl-lab", "sandbox", "serve"]
    parsed = {}
    monkeypatch.setattr(cli, "_sandbox", lambda args: parsed.update(vars(args)))
    cli.main(c["command"][1:])
    (port,) = one(docs, "Service", SANDBOX)["spec"]["ports"]
    assert parsed["host"] == "0.0.0.0" and parsed["port"] == port["port"] == c["ports"][0]["containerPort"]
    token_mount = next(m for m in c["volumeMounts"] if m["name"] == "token")
    assert str(parsed["token_file"]).startswith(token_mount["mountPath"] + "/")
    assert volumes["token"]["secret"]["secretName"] == f"{SANDBOX}-token"
    assert secret_data(one(docs, "Secret", f"{SANDBOX}-token"))["token"].startswith("orl-sandbox-")


@pytest.mark.server  # helm renders the chart in a subprocess
def test_the_control_plane_forwards_to_the_sandbox_service_with_the_token_the_sandbox_pods_accept():
    docs = render("values.yaml")
    c = container(docs)
    env = {e["name"]: e.get("value") for e in c["env"]}
    (port,) = one(docs, "Service", SANDBOX)["spec"]["ports"]
    assert env["OPENRL_SANDBOX_REMOTE_URL"] == f"http://{SANDBOX}.{NAMESPACE}.svc:{port['port']}"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert env["OPENRL_SANDBOX_REMOTE_TOKEN_FILE"].startswith(mounts["sandbox-token"] + "/")
    cp_volumes = {v["name"]: v for v in one(docs, "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]["volumes"]}
    sb_volumes = {v["name"]: v for v in sandbox_pod(docs)["volumes"]}
    assert cp_volumes["sandbox-token"]["secret"] == sb_volumes["token"]["secret"]  # one Secret, both ends


@pytest.mark.server  # helm renders the chart in a subprocess
def test_sandbox_pods_reach_nothing_and_only_the_control_plane_reaches_them():
    docs = render("values.yaml")
    spec = one(docs, "NetworkPolicy", SANDBOX)["spec"]
    sb_labels = one(docs, "Deployment", SANDBOX)["spec"]["template"]["metadata"]["labels"]
    cp_labels = one(docs, "Deployment", CONTROL_PLANE)["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict, labels: dict) -> bool:
        return selector["matchLabels"].items() <= labels.items()

    assert selects(spec["podSelector"], sb_labels) and not selects(spec["podSelector"], cp_labels)
    # Egress listed with no rule: every connection out is denied (DNS, the API server, other Pods, the internet)
    assert spec["policyTypes"] == ["Ingress", "Egress"] and spec.get("egress", []) == []
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"} and selects(peer["podSelector"], cp_labels)
    assert not selects(peer["podSelector"], sb_labels)
    assert [p["port"] for p in rule["ports"]] == [one(docs, "Service", SANDBOX)["spec"]["ports"][0]["port"]]
    # no other policy admits anything to the sandbox Pods
    others = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] != SANDBOX]
    assert not any(selects(d["spec"]["podSelector"], sb_labels) for d in others)


@pytest.mark.server  # helm renders the chart in a subprocess
def test_sandbox_disabled_renders_none_of_it_and_the_control_plane_runs_programs_itself():
    docs = render("values.yaml", sets=("sandbox.enabled=false",))
    assert not [d["metadata"]["name"] for d in docs if "sandbox" in d["metadata"]["name"]]
    c = container(docs)
    assert not [e for e in c["env"] if e["name"].startswith("OPENRL_SANDBOX_")]
    assert "sandbox-token" not in {m["name"] for m in c["volumeMounts"]}


@pytest.mark.server  # helm renders the chart in a subprocess
@pytest.mark.parametrize(
    "sets,message",
    [
        (("sandbox.isolation=docker",), r"/sandbox/isolation"),
        (("sandbox.runtimeClassName=Not_A_Name",), r"/sandbox/runtimeClassName"),
        (("sandbox.token.value=hunter2",), r"/sandbox/token/value"),
        (("sandbox.replicas=0",), r"/sandbox/replicas"),
    ],
)
def test_sandbox_values_are_checked_by_the_schema(sets, message):
    assert re.search(message, render_error("values.yaml", sets=sets))
