"""The kernel's side of joining a control plane from another host (`openrl-lab kernel join`; the control plane's
side is openrl_lab/cluster/join.py): a join token proves the kernel, the control plane calls it back on the address
it gave, and a kernel that nobody calls for REJOIN_AFTER_S starts over and joins again. Torch-free."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc

REJOIN_AFTER_S = 10.0  # the control plane pings every second
JOIN_TIMEOUT_S = 30.0


class JoinRefused(RuntimeError):
    """The control plane refused this kernel (a bad token, a taken name...): trying again will not help."""


@dataclass
class ControlPlane:
    target: str  # host:port of its gRPC port
    token: str
    tls: bool
    root_certificates: bytes | None = None

    def channel(self) -> grpc.Channel:
        if self.tls:
            return grpc.secure_channel(self.target, grpc.ssl_channel_credentials(self.root_certificates))
        return grpc.insecure_channel(self.target)


def join(
    cp: ControlPlane, request: pb.JoinRequest, log: Callable[[str], None], give_up_s: float | None = None
) -> pb.JoinReply:
    """Joins, retrying while the control plane is unreachable (it may be starting); JoinRefused when it says no."""
    request.token = cp.token
    wait, started = 1.0, time.monotonic()
    while True:
        with cp.channel() as channel:
            try:
                return pb_grpc.FleetStub(channel).Join(request, timeout=JOIN_TIMEOUT_S)
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
        if code in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.PERMISSION_DENIED,
        ):
            raise JoinRefused(details)
        if give_up_s is not None and time.monotonic() - started > give_up_s:
            raise ConnectionError(f"cannot reach the control plane at {cp.target}: {details}")
        log(f"cannot reach the control plane at {cp.target} ({code.name}: {details}); trying again in {wait:.0f} s")
        time.sleep(wait)
        wait = min(30.0, wait * 2)
