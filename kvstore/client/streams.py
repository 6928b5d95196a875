"""Lookups on one long-lived gRPC stream (``MetaService.LookupStream``).

A unary gRPC call in Python costs a call's set-up on both sides, about half of a lookup's round
trip; a stream pays it once. Requests are pipelined: callers queue them in turn (their futures
in the same order), the service answers in order, and one reader task hands each answer to the oldest
waiting caller. A refusal from the service (bad input, permission) ends the stream: the caller
whose request it answers (the oldest waiting) gets it, typed; the others, whose requests may be
fine, are asked again with unary calls. A stream the transport ends (the service away, a gRPC core
error) blames nobody: every waiting caller is asked again. The next lookup opens a new stream. A service without the method (older) is
asked with unary calls from then on.

Each call's requests come from an iterator of the stream's own (:class:`_Requests`), which the
stream ends whenever the call ends, however it ends. gRPC consumes such an iterator with a task
of its own; a call written to with ``call.write`` through a client interceptor (the bearer token
of ``client.token``, :func:`kvstore.tls.aio_channel`) has such a task too, over an iterator that
nobody ends once the service has ended the call: that task would be left pending, and destroyed
pending when the client's loop closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import grpc

from kvstore.errors import KVStoreError, Unavailable, from_rpc_error

log = logging.getLogger("kvstore.client")
# How long close() waits for the service to end the stream before it cancels the call.
_CLOSE_GRACE_S = 2.0
# Statuses with which the service refuses one request (the one the stream was answering).
_REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


class _Requests:
    """The requests of one call, in the order callers queued them, until :meth:`end`."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        request = await self._queue.get()
        if request is None:
            raise StopAsyncIteration
        return request

    def put(self, request: Any) -> None:
        self._queue.put_nowait(request)

    def end(self) -> None:
        self._queue.put_nowait(None)


class LookupStream:
    def __init__(self, stub: Any, unary: Any, timeout_s: float) -> None:
        self._stub = stub
        self._unary = unary  # fallback: (request) -> awaitable response, typed errors
        self._timeout_s = timeout_s
        self._call: Any = None
        self._requests: _Requests | None = None
        self._reader: asyncio.Task | None = None
        self._waiting: deque[asyncio.Future] = deque()
        self._unsupported = False

    async def ask(self, request: Any) -> Any:
        if self._unsupported:
            return await self._unary(request)
        if self._call is None:
            self._open()
        call, requests = self._call, self._requests
        assert requests is not None
        # Queued with its caller's future in one step (no await between): answers come back in
        # the order of the queue. A request queued on a call that has ended meanwhile is asked
        # again when the reader ends the call (_reset).
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        requests.put(request)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self._timeout_s)
        except asyncio.TimeoutError:
            # Answers after this one would go to the wrong callers: start over.
            self._reset(call, Unavailable(f"no lookup answer within {self._timeout_s:.1f} s"))
            raise Unavailable(f"no lookup answer within {self._timeout_s:.1f} s") from None
        except _Unimplemented:
            self._unsupported = True
            return await self._unary(request)
        except _AskAgain:
            return await self._unary(request)

    def _open(self) -> None:
        self._requests = _Requests()
        self._call = self._stub.LookupStream(self._requests)
        self._reader = asyncio.get_running_loop().create_task(self._read(self._call))

    async def _read(self, call: Any) -> None:
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:  # ended cleanly: no request to blame, all asked again
                    self._reset(call, None)
                    return
                while self._waiting:
                    fut = self._waiting.popleft()
                    if not fut.done():
                        fut.set_result(resp)
                        break
                else:
                    raise Unavailable("the lookup stream answered a request nobody asked")
        except asyncio.CancelledError:
            self._reset(call, Unavailable("the client closed"), everyone=True)
            raise
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self._reset(call, _Unimplemented())
            elif code in _REFUSALS:
                self._reset(call, from_rpc_error(e))  # the service refused the oldest request
            else:
                # The transport ended it (unavailable, cancelled, an internal error of the gRPC
                # core when a write raced the end): no request is to blame; all are asked again.
                self._reset(call, None)
        except KVStoreError as e:
            self._reset(call, e)

    def _reset(self, call: Any, err: Exception | None, everyone: bool = False) -> None:
        """Ends the stream: the oldest waiting caller gets ``err`` (its request is the one the
        service answered with it); the others are asked again (unary), unless ``everyone`` fails.
        Without ``err`` every waiting caller is asked again."""
        if call is not self._call or call is None:
            return
        self._call = None
        call.cancel()
        if self._requests is not None:  # gRPC's task that sends them ends with it
            self._requests.end()
            self._requests = None
        waiting, self._waiting = self._waiting, deque()
        first = err is not None
        for fut in waiting:
            if fut.done():
                continue
            if first or (err is not None and (everyone or isinstance(err, _Unimplemented))):
                fut.set_exception(err)
            else:
                fut.set_exception(_AskAgain())
            first = False
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None
        log.debug("event=lookup_stream_reset reason=%r", str(err))

    async def close(self) -> None:
        """Ends the stream as a client should: no more requests, the service answers those it
        has and ends the call, whose status gRPC receives (its task for that ends with it; a
        call cancelled here would leave that task waiting on gRPC's core after the close). A
        service that has not ended it within the grace has the call cancelled, and callers still
        waiting get Unavailable."""
        call, reader, requests = self._call, self._reader, self._requests
        if call is None:
            return
        if requests is not None:
            requests.end()
        try:
            await asyncio.wait_for(call.code(), min(self._timeout_s, _CLOSE_GRACE_S))
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        self._reset(call, Unavailable("the client closed"), everyone=True)
        # Let the call and its reader finish before the channel closes.
        if reader is not None:
            await asyncio.gather(reader, return_exceptions=True)
        try:
            await call.code()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass


class _Unimplemented(Exception):
    """The service has no LookupStream."""


class _AskAgain(Exception):
    """The stream ended on another caller's request: this one is asked again."""
