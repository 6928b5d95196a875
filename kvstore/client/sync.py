"""``SyncKVStoreClient``: the blocking facade over :class:`KVStoreClient`.

It runs one private event loop in a daemon thread and forwards each call to it, so the async
client stays the single implementation; a get of blocks whose locations the client knows is read
in the calling thread instead (no hop to the loop), and so is a lookup when the service offers
its lookup port (kvstore.meta.lookup_port). Safe to call from several threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvstore.client.client import KVStoreClient, PutResult
from kvstore.client.lookup_port import PortDown
from kvstore.config import ClientConfig
from kvstore.errors import Unavailable
from kvstore.keys import KEY_BYTES, pack_keys
from kvstore.tls import TlsConfig

_CLOSE_GRACE_S = 2.0  # how long close() lets calls in progress finish before it cancels them


async def _settle() -> None:
    """What asyncio.run does before it closes its loop: the tasks still on the client's loop
    once the client has closed (gRPC's own, woken by the close of the channel and its calls) run
    to their end, those still pending after a grace are cancelled, and asynchronous generators
    are closed; a task left pending when the loop closes would be destroyed with a warning."""
    here = asyncio.current_task()
    tasks = {t for t in asyncio.all_tasks() if t is not here}
    if tasks:
        _done, late = await asyncio.wait(tasks, timeout=_CLOSE_GRACE_S)
        for t in late:
            t.cancel()
        if late:
            await asyncio.wait(late, timeout=_CLOSE_GRACE_S)
    await asyncio.get_running_loop().shutdown_asyncgens()


class SyncKVStoreClient:
    def __init__(
        self, meta: str | None = None, config: ClientConfig | None = None, tls: TlsConfig | None = None
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client", daemon=True)
        self._thread.start()
        self._closed = False
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future] = set()
        self._readers = 0  # get_known calls in callers' threads (close waits for them)
        try:
            self._client: KVStoreClient = self._run(self._make(meta, config, tls))
        except BaseException:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            raise

    @staticmethod
    async def _make(meta: str | None, config: ClientConfig | None, tls: TlsConfig | None) -> KVStoreClient:
        return KVStoreClient(meta, config, tls)

    def _run(self, coro):  # noqa: ANN001, ANN202
        """Runs ``coro`` on the client's loop. A call on a closed client, or one that close()
        cut short, raises Unavailable (never hangs, never an untyped error)."""
        with self._lock:
            if self._closed:
                coro.close()
                raise Unavailable("the client is closed")
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._pending.add(fut)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise Unavailable("the client was closed during the call") from None
        finally:
            with self._lock:
                self._pending.discard(fut)

    def __enter__(self) -> SyncKVStoreClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes the client. Calls in progress in other threads get a moment to finish (copies
        into their buffers end before they return); those still waiting after it (on a service
        that does not answer) end with Unavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=_CLOSE_GRACE_S)
        for fut in pending:
            fut.cancel()
        deadline = time.monotonic() + _CLOSE_GRACE_S
        while self._readers and time.monotonic() < deadline:  # shared-memory reads end first
            time.sleep(0.001)
        try:
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result()
        finally:
            try:
                asyncio.run_coroutine_threadsafe(_settle(), self._loop).result()
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()

    def lookup(self, keys: Sequence[bytes] | bytes) -> int:
        hit = self._on_port(keys, False)
        return hit[0] if hit is not None else self._run(self._client.lookup(keys))

    def exists(self, keys: Sequence[bytes] | bytes) -> list[bool]:
        hit = self._on_port(keys, True)
        return [bool(x) for x in hit[1]] if hit is not None else self._run(self._client.exists(keys))

    def _on_port(self, keys: Sequence[bytes] | bytes, per_key: bool) -> tuple[int, bytes] | None:
        """A lookup on the service's lookup port, in this thread; None: ask over gRPC."""
        port = self._client.lookup_port
        if port is None or self._closed:
            return None
        packed = pack_keys(keys)
        if not port.usable(len(packed) // KEY_BYTES):
            return None
        try:
            return port.ask(packed, per_key)
        except PortDown as e:
            if self._closed:
                raise Unavailable("the client is closed") from None
            self._client.lookup_port_failed(str(e))
            return None

    def lookup_tiers(self, keys: Sequence[bytes] | bytes):  # noqa: ANN201 - kvstore.client.engines.TierLookup
        return self._run(self._client.lookup_tiers(keys))

    def report_engine_blocks(self, engine_id: str, url: str = "", added=(), removed=(), **kw) -> int:  # noqa: ANN001, ANN003
        return self._run(self._client.report_engine_blocks(engine_id, url, added, removed, **kw))

    def get_into(self, keys: Sequence[bytes] | bytes, buffers: Sequence[Any]) -> int:
        # Known blocks are read here, in the caller's thread; the rest through the event loop.
        with self._lock:
            if self._closed:
                raise Unavailable("the client is closed")
            self._readers += 1
        try:
            done = self._client.get_known(keys, buffers)
        finally:
            with self._lock:
                self._readers -= 1
        if done == len(buffers):
            return done
        rest = pack_keys(keys)[done * KEY_BYTES :]
        return done + self._run(self._client.get_into(rest, buffers[done:]))

    def put(self, keys: Sequence[bytes] | bytes, buffers: Sequence[Any], *, chain: bool = True) -> PutResult:
        return self._run(self._client.put(keys, buffers, chain=chain))

    def remove(self, keys: Sequence[bytes] | bytes) -> int:
        return self._run(self._client.remove(keys))

    def pin(self, keys: Sequence[bytes] | bytes) -> int:
        return self._run(self._client.pin(keys))

    def unpin(self, keys: Sequence[bytes] | bytes) -> int:
        return self._run(self._client.unpin(keys))

    def location_stats(self) -> dict[str, int]:
        return self._client.location_stats()

    def read_stats(self) -> dict[str, int]:
        return self._client.read_stats()

    def stats(self):  # noqa: ANN201
        return self._run(self._client.stats())

    def cluster_state(self) -> dict | None:
        return self._run(self._client.cluster_state())

    def advance_clock(self, seconds: float) -> float:
        return self._run(self._client.advance_clock(seconds))
