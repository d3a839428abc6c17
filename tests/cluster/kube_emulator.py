"""A Kubernetes API emulator for the launcher's contract tests: kmock's `KubernetesEmulator` (an in-memory API
over real HTTP on 127.0.0.1) with the shims docs/../shared reference lists, validating every create strictly
against the Kubernetes 1.34 schema (kubernetes-validate) and answering 422 as the API server does.

What it is: a check that the launcher sends schema-valid requests over HTTP through the official client, and
reacts to Pod phases the way it should. What it is not: an API server. No label-selector semantics (the launcher
filters what it lists itself), no RBAC (the requests are recorded and checked against `rbac.RULES` instead), no
admission, no scheduling, no DRA allocation. Pods move only when the test's `FakeKubelet` moves them.

kmock's internals are used (`_lock`, `_buses`, `_objects`): the test extra pins kmock==0.8.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import re
import secrets
import threading
import uuid
from typing import Any

import attrs
import kmock
import kubernetes
import kubernetes_validate
from kmock._internal import enums

SCHEMA_VERSION = "1.34.0"
PODS = kmock.resource("", "v1", "pods")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str, details: dict | None = None) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or {})


@attrs.define(kw_only=True)
class ValidatingEmulator(kmock.KubernetesEmulator):
    """`requests_seen`: (apiGroup, resource, verb, namespace, query, name) of every API request (the kubelet's changes
    are made in the emulator's loop, not over HTTP).
    `rejected`: the message of each create answered 422. `graceful`: a deleted Pod stays, with a
    deletionTimestamp, until the kubelet finishes it (as on a real node); else it goes at once."""

    requests_seen: list[tuple[str, str, str, str | None, dict, str | None]] = attrs.field(factory=list)
    rejected: list[str] = attrs.field(factory=list)
    graceful: bool = False
    forbidden: bool = False  # answer every request as an API server whose RBAC grants nothing
    _versions: Any = attrs.field(factory=lambda: itertools.count(1000))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Discovery: kmock serves only what is declared (and lists 404 for undeclared resources).
        self.resources["v1/pods"] = kmock.ResourceInfo(
            kind="Pod",
            singular="pod",
            namespaced=True,
            subresources={"status"},
            verbs={"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"},
        )
        for plural, kind in (("resourceclaims", "ResourceClaim"), ("resourceclaimtemplates", "ResourceClaimTemplate")):
            self.resources[f"resource.k8s.io/v1/{plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=True, verbs={"create", "delete", "get", "list", "watch"}
            )

    async def __call__(self, raw_request):
        # kmock knows a watch only by `watch=true`; the official client sends `watch=True`.
        if raw_request.method == "GET" and raw_request.query.get("watch", "").lower() in ("true", "1"):
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.update_query(watch="true"))
        return await super().__call__(raw_request)

    async def _handle(self, request):
        if request.resource is not None:
            if self.forbidden:
                raise _status(
                    403,
                    "Forbidden",
                    f'{request.resource.plural} is forbidden: User "system:serviceaccount:'
                    f'lab:openrl-lab" cannot {_verb(request)} resource '
                    f'"{request.resource.plural}" in API group "{request.resource.group}" '
                    f'in the namespace "{request.namespace}"',
                )
            self.requests_seen.append(
                (
                    request.resource.group,
                    request.resource.plural + (f"/{request.subresource}" if request.subresource else ""),
                    _verb(request),
                    request.namespace,
                    dict(request.params),
                    request.name,
                )
            )
            if request.action == enums.action.CREATE:
                self._admit(request)
            elif (
                self.graceful
                and request.action == enums.action.DELETE
                and request.resource == PODS
                and request.name is not None
            ):
                return await self._start_deletion(request)
        return await super()._handle(request)

    def _admit(self, request) -> None:
        """What the API server does with a create before storing it: defaulting and validation."""
        body = request.data
        if not isinstance(body, dict):
            raise _status(400, "BadRequest", "the request body is not a JSON object")
        group, version = request.resource.group, request.resource.version
        body.setdefault("apiVersion", f"{group}/{version}" if group else version)
        # not .get(): kmock's resources add an empty record on a missing key ([] and so .get() alike)
        info = self.resources[request.resource] if request.resource in self.resources else None  # noqa: SIM401
        if info is not None and info.kind:
            body.setdefault("kind", info.kind)
        meta = body.setdefault("metadata", {})
        if request.namespace and meta.setdefault("namespace", request.namespace) != request.namespace:
            raise _status(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name") or ""
        try:
            kubernetes_validate.validate(body, SCHEMA_VERSION, strict=True)
            if not DNS_SUBDOMAIN.fullmatch(name) or len(name) > 253:
                raise ValueError(
                    f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain must "
                    "consist of lower case alphanumeric characters, '-' or '.'"
                )
        except (kubernetes_validate.ValidationError, ValueError) as e:
            message = f"{body.get('kind')} {name!r} is invalid: {str(e).splitlines()[0]}"
            self.rejected.append(message)
            raise _status(
                422,
                "Invalid",
                message,
                {"name": name, "kind": body.get("kind"), "causes": [{"message": str(e).splitlines()[0]}]},
            ) from None
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(self._versions)), creationTimestamp=_now())
        if request.resource == PODS:
            body["status"] = {"phase": "Pending", "qosClass": "Burstable"}

    async def _start_deletion(self, request):
        key = (PODS, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            obj = self._objects[key]
            if not obj.get("metadata", {}).get("deletionTimestamp"):
                obj.patch(
                    {
                        "metadata": {
                            "deletionTimestamp": _now(),
                            "deletionGracePeriodSeconds": 30,
                            "resourceVersion": str(next(self._versions)),
                        }
                    }
                )
                await self._buses[PODS].put({"type": "MODIFIED", "object": obj.raw})
            raw = obj.raw
        import aiohttp.web

        return aiohttp.web.json_response(raw)

    # --- the kubelet's side (called in the emulator's loop) ------------------------------------------------
    async def pods(self, namespace: str) -> dict[str, dict]:
        async with self._lock:
            return {
                name: obj.raw
                for (res, ns, name), obj in self._objects.items()
                if res == PODS and ns == namespace and not obj.deleted
            }

    async def set_status(self, namespace: str, name: str, status: dict, uid: str | None = None) -> bool:
        """Merges `status` into the Pod's (if it is still the Pod `uid`); False when it is gone."""
        async with self._lock:
            key = (PODS, namespace, name)
            if key not in self._objects or self._objects[key].deleted:
                return False
            obj = self._objects[key]
            if uid is not None and obj.get("metadata", {}).get("uid") != uid:
                return False
            obj.patch({"status": status, "metadata": {"resourceVersion": str(next(self._versions))}})
            await self._buses[PODS].put({"type": "MODIFIED", "object": obj.raw})
            return True

    async def remove(self, namespace: str, name: str) -> bool:
        """The Pod is gone from the API (a node finished its deletion, or someone deleted it at once)."""
        async with self._lock:
            key = (PODS, namespace, name)
            if key not in self._objects or self._objects[key].deleted:
                return False
            obj = self._objects[key]
            raw = obj.raw
            obj.delete()
            await self._buses[PODS].put({"type": "DELETED", "object": raw})
            return True


def _verb(request) -> str:
    """The RBAC verb of a request, as the API server's authorizer names it."""
    action = request.action
    if action == enums.action.WATCH:
        return "watch"
    if request.method == "GET":
        return "get" if request.name else "list"
    if request.method == "POST":
        return "create"
    if request.method == "PUT":
        return "update"
    if request.method == "PATCH":
        return "patch"
    if request.method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return request.method.lower()


class EmulatorThread:
    """The emulator served on 127.0.0.1 from its own event loop in a thread, for synchronous tests."""

    def __init__(self, graceful: bool = False):
        self.graceful = graceful
        self.emulator: ValidatingEmulator | None = None
        self.url = ""

    def __enter__(self) -> EmulatorThread:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            try:
                async with ValidatingEmulator(graceful=self.graceful) as emu, kmock.Server(emu) as server:
                    self.emulator, self.url = emu, str(server.url).rstrip("/")
                    self._done = asyncio.Event()
                    ready.set()
                    await self._done.wait()
            except BaseException as e:  # noqa: BLE001 - reported to the test
                failure.append(e)
                ready.set()

        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(main(),), daemon=True, name="kube-emulator"
        )
        self.thread.start()
        ready.wait(30)
        if failure or self.emulator is None:
            raise RuntimeError(f"the emulator did not start: {failure}")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._done.set)
        self.thread.join(15)

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def configuration(self) -> kubernetes.client.Configuration:
        cfg = kubernetes.client.Configuration()
        cfg.host = self.url
        return cfg

    def kubeconfig(self, path, namespace: str) -> None:
        """A kubeconfig file naming the emulator (for a control plane started as its own process)."""
        import json

        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emulator",
                    "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                    "users": [{"name": "test", "user": {"token": "not-checked"}}],
                    "contexts": [
                        {"name": "emulator", "context": {"cluster": "emulator", "user": "test", "namespace": namespace}}
                    ],
                }
            )
        )


class FakeKubelet:
    """Moves the emulator's Pods through their phases, as a node would, when the test says so."""

    def __init__(self, emu: EmulatorThread, namespace: str):
        self.emu, self.namespace = emu, namespace
        self._ips = itertools.count(2)

    def pods(self) -> dict[str, dict]:
        return self.emu.call(self.emu.emulator.pods(self.namespace))

    def run(self, name: str, ip: str | None = None) -> str:
        ip = ip or f"10.0.0.{next(self._ips)}"
        pod = self.pods()[name]
        started = _now()
        self._set(
            name,
            {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": started,
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c["image"],
                        "imageID": "",
                        "ready": True,
                        "restartCount": 0,
                        "started": True,
                        "state": {"running": {"startedAt": started}},
                    }
                    for c in pod["spec"]["containers"]
                ],
            },
            pod["metadata"]["uid"],
        )
        return ip

    def fail(
        self, name: str, exit_code: int = 1, reason: str = "Error", message: str | None = None, phase: str = "Failed"
    ) -> None:
        pod = self.pods()[name]
        term = {"exitCode": exit_code, "reason": reason, "startedAt": _now(), "finishedAt": _now()}
        if message:
            term["message"] = message
        self._set(
            name,
            {
                "phase": phase,
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c["image"],
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"terminated": term},
                    }
                    for c in pod["spec"]["containers"]
                ],
            },
            pod["metadata"]["uid"],
        )

    def evict(self, name: str, message: str = "The node was low on resource: memory.") -> None:
        pod = self.pods()[name]
        self._set(name, {"phase": "Failed", "reason": "Evicted", "message": message}, pod["metadata"]["uid"])

    def remove(self, name: str) -> bool:
        return self.emu.call(self.emu.emulator.remove(self.namespace, name))

    def _set(self, name: str, status: dict, uid: str) -> None:
        if not self.emu.call(self.emu.emulator.set_status(self.namespace, name, status, uid)):
            raise AssertionError(f"Pod {name} is gone")
