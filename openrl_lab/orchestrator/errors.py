"""Errors of the orchestrator, one class per gRPC status code (torch-free, grpc-free).

The scheduler raises them; the gRPC service turns them into the status code named by `code`, with the
message; the client turns a status back into the same class. So `except NotFound` works the same
in-process and over the wire.
"""

from __future__ import annotations


class OrchestratorError(Exception):
    code = "UNKNOWN"


class InvalidArgument(OrchestratorError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(OrchestratorError, LookupError):
    code = "NOT_FOUND"


class FailedPrecondition(OrchestratorError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(OrchestratorError):
    code = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(OrchestratorError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(OrchestratorError):
    code = "CANCELLED"


class Unauthenticated(OrchestratorError, PermissionError):
    code = "UNAUTHENTICATED"


class PermissionDenied(OrchestratorError, PermissionError):
    code = "PERMISSION_DENIED"


class Unavailable(OrchestratorError, ConnectionError):
    code = "UNAVAILABLE"


class Internal(OrchestratorError):
    code = "INTERNAL"


BY_CODE: dict[str, type[OrchestratorError]] = {
    c.code: c
    for c in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        DeadlineExceeded,
        Cancelled,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        Internal,
    )
}
