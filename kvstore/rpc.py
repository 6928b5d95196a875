"""Serving a gRPC service with the status chosen by cause, in one place, for every server.

:func:`add_service` registers a servicer from its service descriptor instead of the generated
``add_*_to_server``, with two differences that every kvstore server needs:

- a request body that does not parse as its message (truncated, random, invalid UTF-8 in a
  string field) is answered INVALID_ARGUMENT naming the message, instead of failing inside
  gRPC's deserializer (which answers UNKNOWN or INTERNAL);
- whatever a handler raises becomes a status by cause: a :class:`~kvstore.errors.KVStoreError`
  its own code, anything else INTERNAL (logged with its traceback), never UNKNOWN.

Handlers may be plain functions or coroutines; server-streaming methods (gRPC health's
``Watch``) may be async generators or coroutines that write to the context.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import KVStoreError

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


def _wrap(service: str, method: str, fn: Any) -> Any:
    """The handler for one method: a unary method returns ``fn``'s result; a server-streaming one
    writes what an async-generator ``fn`` yields (or lets ``fn`` write to the context)."""

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, BadRequest):
            log.info("rpc=%s error=InvalidArgument reason=%r", method, request.reason)
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
            log.info("rpc=%s error=%s reason=%r", method, type(e).__name__, e.message)
            await context.abort(e.code, e.message)
        except Exception as e:  # noqa: BLE001 - a bug: INTERNAL with its cause, never UNKNOWN
            log.exception("rpc=%s.%s error=internal", service, method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}: {e}")

    handler.__name__ = method
    return handler


def add_service(server: grpc.aio.Server, pb2: Any, service_name: str, servicer: Any) -> None:
    """Registers ``servicer``'s methods for ``service_name`` of the generated module ``pb2``
    (unary-unary, or unary-stream as in gRPC health's ``Watch``)."""
    desc = pb2.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for m in desc.methods:
        req_cls = getattr(pb2, m.input_type.name, None) or _message_class(m.input_type)
        resp_cls = getattr(pb2, m.output_type.name, None) or _message_class(m.output_type)
        fn = getattr(servicer, m.name)
        if m.client_streaming:
            raise ValueError(f"{desc.full_name}.{m.name}: client-streaming methods are not supported")
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(
            _wrap(desc.full_name, m.name, fn),
            request_deserializer=_deserializer(req_cls),
            response_serializer=resp_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))


def _message_class(descriptor: Any) -> type:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)
