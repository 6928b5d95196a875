"""The error taxonomy: one class per failure kind, each mapped once to a gRPC status code.

Misses are data, never exceptions: a lookup or ``get_into`` that finds nothing returns 0.
Servers raise these; ``grpc_abort`` turns them into a status, and ``from_rpc_error`` turns a
status back into the same class on the client.
"""

from __future__ import annotations

import grpc


class KVStoreError(Exception):
    """Base class. ``retryable`` says whether the same call may succeed if simply tried again."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KVStoreError, ValueError):
    """The request is malformed (key length, sizes, batch limits, config). Nothing was changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVStoreError, LookupError):
    """A named daemon, put or lease does not exist (never used for a missing block)."""

    code = grpc.StatusCode.NOT_FOUND


class Expired(KVStoreError):
    """A put reservation or read lease outlived its deadline and was reclaimed."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    retryable = True


class ResourceExhausted(KVStoreError):
    """No space even after eviction: everything evictable is leased, pinned or in flight."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class Unavailable(KVStoreError, ConnectionError):
    """A service or daemon could not be reached."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class Timeout(KVStoreError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class PermissionDenied(KVStoreError, PermissionError):
    """The caller may not make this call (its role or identity), or the call is switched off on
    this server (e.g. clock skew without test mode)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(KVStoreError, PermissionError):
    """The caller presented no credentials the server knows."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Internal(KVStoreError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Expired,
        ResourceExhausted,
        Unavailable,
        Timeout,
        PermissionDenied,
        Unauthenticated,
        Internal,
    )  # fmt: skip
}


def error_for(code: grpc.StatusCode, message: str) -> KVStoreError:
    """The typed error for a status code (Internal for one without its own type)."""
    return _BY_CODE.get(code, Internal)(message or code.name)


def from_rpc_error(err: grpc.RpcError) -> KVStoreError:
    """The typed error for a failed RPC (``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return error_for(code, details)


async def grpc_abort(context: grpc.aio.ServicerContext, exc: KVStoreError) -> None:
    await context.abort(exc.code, exc.message)
