"""deploy/jupyterhub/values.yaml: the "OpenRL Lab" profile rendered into user Pods by the real KubeSpawner (offline:
`_mock=True`, a kubeconfig that points nowhere), for two users, validated against the Kubernetes schemas, and each
user's Pod holding that user's own key from the chart's Secret, with which `find_connection` (what `%openrl
connect` calls) reaches the chart's control plane.

Layer: z2jh's own jupyterhub_config.py is not run (its chart is not installable here); `hub_config` does the two
mappings it would do for the keys these values use (singleuser.profileList -> KubeSpawner.profile_list,
hub.extraConfig snippets executed), and the test refuses values that use any other key. No Pod is started."""

from __future__ import annotations

import asyncio
import os

import pytest
import yaml
from traitlets.config import Config

from openrl_lab.lab import connection
from openrl_lab.lab.connection import LabError, find_connection
from tests.deploy.chart import CONTROL_PLANE, FULLNAME, REPO, SCHEMA_VERSIONS, one, render, secret_data, validate

HUB_VALUES = yaml.safe_load((REPO / "deploy" / "jupyterhub" / "values.yaml").read_text())
PROFILE = "openrl-lab"
USERS = ("alice", "bob")  # both in the chart's values.yaml apiKeys.users
DUMMY_KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none, namespace: openrl}}]
current-context: none
"""


def hub_config() -> Config:
    assert set(HUB_VALUES) == {"hub", "singleuser"} and set(HUB_VALUES["hub"]) == {"extraConfig"}
    assert set(HUB_VALUES["singleuser"]) == {"profileList", "networkPolicy"}  # networkPolicy: z2jh's templates
    c = Config()
    c.KubeSpawner.profile_list = HUB_VALUES["singleuser"]["profileList"]
    for _, snippet in sorted(HUB_VALUES["hub"]["extraConfig"].items()):
        exec(snippet, {"c": c})  # as z2jh's jupyterhub_config.py does, with `c` in scope
    return c


class HubUser:
    def __init__(self, name: str):
        self.name, self.id, self.url = name, abs(hash(name)) % 1000, f"/user/{name}/"


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """user -> (the Pod KubeSpawner renders for the profile, as JSON; the pre-spawn hook's verdict)."""
    kubeconfig = tmp_path_factory.mktemp("kube") / "config"
    kubeconfig.write_text(DUMMY_KUBECONFIG)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(kubeconfig))
        from kubernetes_asyncio.client import ApiClient
        from kubespawner import KubeSpawner

        config = hub_config()

        async def spawn_all():
            out = {}
            async with ApiClient() as api:
                for name in (*USERS, "carol", "a@b"):
                    spawner = KubeSpawner(config=config, _mock=True, user=HubUser(name))
                    spawner.user_options = {"profile": PROFILE}
                    try:
                        config.KubeSpawner.pre_spawn_hook(spawner)
                        refused = None
                    except ValueError as e:
                        refused = str(e)
                    await spawner.load_user_options()
                    pod = api.sanitize_for_serialization(await spawner.get_pod_manifest())
                    out[name] = (pod, refused)
            return out

        return asyncio.run(spawn_all())


def env_of(pod: dict) -> dict[str, dict]:
    (c,) = pod["spec"]["containers"]
    return {e["name"]: e for e in c["env"]}


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_profile_pods_from_the_real_kubespawner_validate_against_k8s_schemas(spawned, version):
    for user in USERS:
        pod, _ = spawned[user]
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        validate(pod, version)


@pytest.mark.server  # runs helm or a lab
def test_two_users_each_get_their_own_key_and_the_control_planes_address(spawned):
    chart = render("values.yaml")
    keys = one(chart, "Secret", f"{FULLNAME}-api-keys")
    service = one(chart, "Service", CONTROL_PLANE)
    url = f"http://{service['metadata']['name']}:8000"
    assert 8000 in [p["port"] for p in service["spec"]["ports"]]
    refs = {}
    for user in USERS:
        pod, refused = spawned[user]
        assert refused is None
        env = env_of(pod)
        assert env["OPENRL_LAB_URL"]["value"] == env["TINKER_BASE_URL"]["value"] == url
        ref = env["TINKER_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": keys["metadata"]["name"], "key": user, "optional": True}
        refs[user] = ref["key"]
        assert pod["spec"]["containers"][0]["image"] == "openrl-lab-singleuser:0.1.0"
        resources = pod["spec"]["containers"][0]["resources"]
        assert set(resources["limits"]) == set(resources["requests"]) == {"cpu", "memory"}
        # no API token in a user's Pod, so the user cannot read the Secret (and others' keys) from it
        assert pod["spec"].get("automountServiceAccountToken") is False
    assert refs == {"alice": "alice", "bob": "bob"}


@pytest.mark.server  # runs helm or a lab
def test_find_connection_in_each_users_pod_reaches_the_control_plane_with_that_users_key(
    spawned, monkeypatch, tmp_path
):
    """The environment the kubelet gives each Pod (its secretKeyRef resolved from the chart's Secret), then
    `find_connection()` with no arguments, as `%openrl connect` calls it."""
    data = secret_data(one(render("values.yaml"), "Secret", f"{FULLNAME}-api-keys"))
    found = {}
    for user in (*USERS, "carol"):
        pod, _ = spawned[user]
        for name in list(os.environ):
            if name.startswith(("OPENRL_", "TINKER_")):
                monkeypatch.delenv(name)
        for name, e in env_of(pod).items():
            if "value" in e:
                monkeypatch.setenv(name, e["value"])
            elif e["valueFrom"]["secretKeyRef"]["key"] in data:  # optional: an absent key sets nothing
                monkeypatch.setenv(name, data[e["valueFrom"]["secretKeyRef"]["key"]])
        url = os.environ["OPENRL_LAB_URL"]
        monkeypatch.setattr(connection, "lab_answers", lambda u, url=url: u == url)  # the control plane is up
        if user == "carol":  # a hub user the chart has no key for: told so, in the notebook
            with pytest.raises(LabError, match="no API key for http://openrl-lab-control-plane:8000"):
                find_connection(home=tmp_path)
            continue
        conn = find_connection(home=tmp_path)
        assert conn.base_url == url
        found[user] = conn.api_key
    assert found == {user: data[user] for user in USERS} and found["alice"] != found["bob"]


def test_user_names_that_cannot_hold_a_key_are_refused_before_spawning(spawned):
    assert spawned["a@b"][1] == (
        "OpenRL Lab: the user name 'a@b' cannot have an API key (letters, digits, '.', "
        "'_' or '-', at most 64): ask your administrator for another name"
    )


@pytest.mark.server  # runs helm or a lab
def test_hub_user_pods_and_the_network_policies_agree(spawned):
    """The chart's control-plane policy admits the labels KubeSpawner puts on user Pods, and the hub values' egress
    rule lets those Pods out to the chart's control plane on 8000 (z2jh blocks private addresses by default)."""
    chart = render("values.yaml")
    pod_labels = spawned["alice"][0]["metadata"]["labels"]
    policy = one(chart, "NetworkPolicy", f"{FULLNAME}-control-plane")
    (hub_rule,) = [r for r in policy["spec"]["ingress"] if [p["port"] for p in r["ports"]] == [8000]]
    assert hub_rule["from"][0]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    (egress,) = HUB_VALUES["singleuser"]["networkPolicy"]["egress"]
    cp_labels = one(chart, "Deployment", CONTROL_PLANE)["spec"]["template"]["metadata"]["labels"]
    assert egress["to"][0]["podSelector"]["matchLabels"].items() <= cp_labels.items()
    assert [p["port"] for p in egress["ports"]] == [8000]
