"""Kernels that join from other hosts (`openrl-lab kernel join`): the control plane's `Fleet.Join` service (the
kernel's side of it is openrl_lab/kernel/join.py). Torch-free.

A kernel proves itself with a join token (made by `openrl-lab tokens create --kernel`, stored hashed, revocable,
never a user's API key). The control plane then calls the kernel back on the address it gave, with the key it
gave (over TLS unless both ends are on loopback), and answers with the identity under which the kernel acquires
slices from the orchestrator. A kernel that nobody calls for a while (`kernel/join.py`'s REJOIN_AFTER_S; the
control plane pings every second) starts over as a new process and joins again: the control plane restarted, or
declared it lost.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import grpc

from openrl_lab.cluster.fleet import Fleet
from openrl_lab.identity import KeyStore, hash_key
from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc
from openrl_lab.orchestrator.config import NAME
from openrl_lab.sockets import is_loopback_host, parse_address


class FleetServicer(pb_grpc.FleetServicer):
    """`Fleet.Join`, served on the orchestrator's gRPC port. `ensure_group(group, device)` -> the group's id,
    made when the orchestrator has none of that name."""

    def __init__(
        self,
        fleet: Fleet,
        store: KeyStore,
        orchestrator_key: str,
        ensure_group: Callable[[str, str], str],
        kernel_ca: bytes | None = None,
        kernel_tls_name: str | None = None,
    ):
        self.fleet, self.store, self.key = fleet, store, orchestrator_key
        self.ensure_group, self.kernel_ca, self.kernel_tls_name = ensure_group, kernel_ca, kernel_tls_name

    def Join(self, request, context):  # noqa: N802 - the gRPC method's name
        if not request.token or self.store.join_token_label(hash_key(request.token)) is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "join token refused: not a valid kernel join token (revoked, mistyped, or not a join "
                "token at all); make one on the control plane with `openrl-lab tokens create --kernel`",
            )
        try:
            for what, value in (("name", request.name), ("group", request.group)):
                if not NAME.fullmatch(value):
                    raise ValueError(
                        f"kernel {what} {value[:100]!r} is not allowed: 1-128 letters, digits and "
                        "._:@/+- starting with a letter or digit"
                    )
            if not re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d{1,3})?", request.device):
                raise ValueError(f"device {request.device[:50]!r} is not a device (cpu, cuda, cuda:N)")
            if not 32 <= len(request.key) <= 256 or not request.key.isascii() or not request.key.isprintable():
                raise ValueError("the kernel's key must be 32-256 printable ASCII characters")
            if not 8 <= len(request.incarnation) <= 64 or not request.incarnation.isalnum():
                raise ValueError("incarnation must be 8-64 letters and digits")
            host, port = parse_address(request.address, "kernel address")
            if not request.tls and not is_loopback_host(host):
                raise ValueError(
                    f"the kernel's address {host} is not loopback: it must serve TLS (openrl-lab kernel "
                    "join --tls-cert FILE --tls-key FILE)"
                )
            shown_host = request.host if request.host.isprintable() and len(request.host) <= 253 else host
            group = self.ensure_group(request.group, f"{shown_host}/{request.device}")
            self.fleet.join(
                request.name,
                group,
                request.device,
                shown_host or host,
                (host, port),
                request.key,
                request.incarnation,
                request.tls,
                hash_key(request.token),
                self.kernel_ca,
                self.kernel_tls_name,
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Exception as e:  # noqa: BLE001 - e.g. the orchestrator refused the group
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(e).__name__}: {e}")
        return pb.JoinReply(name=request.name, orchestrator_key=self.key, group=group)


def add_fleet_service(
    fleet: Fleet,
    store: KeyStore,
    orchestrator_key: str,
    kernel_ca: bytes | None = None,
    kernel_tls_name: str | None = None,
):
    """A `services` entry for `serve_orchestrator`: the Join service on the orchestrator's server."""

    def add(server: grpc.Server, scheduler) -> None:
        pb_grpc.add_FleetServicer_to_server(
            FleetServicer(fleet, store, orchestrator_key, scheduler.ensure_group, kernel_ca, kernel_tls_name), server
        )

    return add
