"""Serving a gRPC service with the status chosen by cause, in one place, for every server.

:func:`add_service` registers a servicer from its service descriptor instead of the generated
``add_*_to_server``, with two differences that every kvstore server needs:

- a request body that does not parse as its message (truncated, random, invalid UTF-8 in a
  string field) is answered INVALID_ARGUMENT naming the message, instead of failing inside
  gRPC's deserializer (which answers UNKNOWN or INTERNAL);
- whatever a handler raises becomes a status by cause: a :class:`~kvstore.errors.KVStoreError`
  its own code, anything else INTERNAL (logged with its traceback), never UNKNOWN.

Every call is measured (latency histogram, errors by code: :mod:`kvstore.metrics`) and runs with
its request context for the logs (:mod:`kvstore.logs`); a failed call logs one line with its
cause.

Handlers may be plain functions or coroutines; server-streaming methods (gRPC health's
``Watch``) may be async generators or coroutines that write to the context.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry

from kvstore.errors import KVStoreError
from kvstore.logs import request_context
from kvstore.metrics import rpc_metrics

log = logging.getLogger("kvstore.rpc")

# Options of every kvstore gRPC server and channel.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.so_reuseport", 0),
]


class BadRequest:
    """What the safe deserializer returns for a body that does not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _deserializer(cls: type) -> Any:
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, UnicodeDecodeError, RuntimeError) as e:
            return BadRequest(f"request body is not a valid {name}: {e}")

    return parse


# Request ids: unique in the process (a pid prefix), cheap (a counter).
_ids = itertools.count(1)
_ID_PREFIX = f"{os.getpid():x}-"
_CONTEXT_FIELDS = ("put_id", "lease_id", "daemon_id")


def _context(method: str, request: Any) -> tuple[tuple[str, Any], ...]:
    ctx: list[tuple[str, Any]] = [("rpc", method), ("request_id", _ID_PREFIX + format(next(_ids), "x"))]
    for name in _CONTEXT_FIELDS:
        v = getattr(request, name, None)
        if v:
            ctx.append((name, v))
    return tuple(ctx)


def _wrap(service: str, method: str, fn: Any, registry: CollectorRegistry | None) -> Any:
    """The handler for one method: a unary method returns ``fn``'s result; a server-streaming one
    writes what an async-generator ``fn`` yields (or lets ``fn`` write to the context)."""
    if registry is not None:
        duration, error = rpc_metrics(registry).method(service, method)
        observe = duration.observe
    else:
        observe = error = None

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = time.perf_counter()
        token = request_context.set(_context(method, request))
        code = "OK"
        try:
            if isinstance(request, BadRequest):
                code = "INVALID_ARGUMENT"
                log.info("event=rpc_failed code=%s reason=%r", code, request.reason)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            try:
                result = fn(request, context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        await context.write(item)
                    return None
                if inspect.isawaitable(result):
                    result = await result
                return result
            except grpc.aio.AbortError:
                raise
            except KVStoreError as e:
                code = e.code.name
                log.info("event=rpc_failed code=%s error=%s reason=%r", code, type(e).__name__, e.message)
                await context.abort(e.code, e.message)
            except Exception as e:  # noqa: BLE001 - a bug: INTERNAL with its cause, never UNKNOWN
                code = "INTERNAL"
                log.exception("event=rpc_failed code=INTERNAL service=%s", service)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}: {e}")
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            request_context.reset(token)
            if observe is not None:
                observe(time.perf_counter() - t0)
                if code != "OK":
                    error(code)

    handler.__name__ = method
    return handler


def _wrap_each(unary: Any) -> Any:
    """A bidirectional stream answered message by message, in order, by a unary handler (its
    checks, errors and metrics per message); an error ends the stream with its status."""

    async def handler(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            yield await unary(request, context)

    handler.__name__ = getattr(unary, "__name__", "stream")
    return handler


def add_service(
    server: grpc.aio.Server, pb2: Any, service_name: str, servicer: Any, registry: CollectorRegistry | None = None
) -> None:
    """Registers ``servicer``'s methods for ``service_name`` of the generated module ``pb2``
    (unary-unary, unary-stream as in gRPC health's ``Watch``, stream-unary, whose servicer
    method reads the stream of requests (each a message or a :class:`BadRequest`) and answers
    once, or a bidirectional stream whose servicer method answers one message, see
    :func:`_wrap_each`), unary and stream-unary ones and each message of
    a bidirectional stream measured into ``registry`` (a long-lived stream such as ``Watch`` has
    no latency worth a histogram)."""
    desc = pb2.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for m in desc.methods:
        req_cls = getattr(pb2, m.input_type.name, None) or _message_class(m.input_type)
        resp_cls = getattr(pb2, m.output_type.name, None) or _message_class(m.output_type)
        fn = getattr(servicer, m.name)
        if m.client_streaming and not m.server_streaming:  # the servicer reads the stream itself
            handlers[m.name] = grpc.stream_unary_rpc_method_handler(
                _wrap(desc.full_name, m.name, fn, registry),
                request_deserializer=_deserializer(req_cls),
                response_serializer=resp_cls.SerializeToString,
            )
            continue
        if m.client_streaming:
            handlers[m.name] = grpc.stream_stream_rpc_method_handler(
                _wrap_each(_wrap(desc.full_name, m.name, fn, registry)),
                request_deserializer=_deserializer(req_cls),
                response_serializer=resp_cls.SerializeToString,
            )
            continue
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(
            _wrap(desc.full_name, m.name, fn, None if m.server_streaming else registry),
            request_deserializer=_deserializer(req_cls),
            response_serializer=resp_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))


class ServerHealth:
    """gRPC health of one server: its service names (and "") SERVING or NOT_SERVING together
    (readiness), and ``kvstore.liveness`` SERVING from :meth:`start` to :meth:`stop` whatever
    else happens (liveness: the process answers)."""

    LIVENESS = "kvstore.liveness"

    def __init__(self, service: str) -> None:
        self.servicer = health.aio.HealthServicer()
        self.names = ("", service)
        self.serving = False

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            await self.servicer.set(name, status)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.servicer.set(self.LIVENESS, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        await self.set_serving(False)
        await self.servicer.set(self.LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)


def _message_class(descriptor: Any) -> type:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)
