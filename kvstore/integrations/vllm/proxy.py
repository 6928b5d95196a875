"""Prefill/decode disaggregation in front of two vLLM OpenAI servers that share kvstore.

    python -m kvstore.integrations.vllm.proxy --prefill http://P:8100 --decode http://D:8200 --port 8000

The prefill server runs the connector as ``kv_producer``, the decode server as ``kv_consumer``.
Each completion (``/v1/completions``, ``/v1/chat/completions``) goes first to the prefill server
with one output token (it computes the prompt's KV, and its connector stores the blocks before the
answer leaves), then, unchanged, to the decode server, which loads the prompt's blocks from
kvstore and generates; its answer (streamed or not) is the client's. If the prefill server fails,
the decode server computes the prompt itself: slower, same tokens. ``/v1/models`` and
``/health`` are the decode server's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import aiohttp
from aiohttp import web

log = logging.getLogger("kvstore.vllm.proxy")


def make_app(prefill: str, decode: str, timeout_s: float = 600.0) -> web.Application:
    app = web.Application()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    state: dict = {"prefill_failures": 0, "requests": 0}

    async def session() -> aiohttp.ClientSession:
        if "session" not in state:
            state["session"] = aiohttp.ClientSession(timeout=timeout)
        return state["session"]

    async def completion(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response(
                {"error": {"message": "the body is not JSON", "type": "invalid_request"}}, status=400
            )
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "the body is not an object", "type": "invalid_request"}}, status=400
            )
        s = await session()
        state["requests"] += 1
        first = {**body, "max_tokens": 1, "stream": False}
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        first.pop("stream_options", None)
        try:
            async with s.post(prefill + request.path, json=first) as r:
                await r.read()
                if r.status != 200:
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            state["prefill_failures"] += 1
            log.warning("event=prefill_failed reason=%r effect=decode_computes_the_prompt", str(e))
        async with s.post(decode + request.path, json=body) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "")})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def passthrough(request: web.Request) -> web.Response:
        s = await session()
        async with s.get(decode + request.path) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({k: v for k, v in state.items() if k != "session"})

    async def close(app: web.Application) -> None:
        if "session" in state:
            await state["session"].close()

    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_get("/v1/models", passthrough)
    app.router.add_get("/health", passthrough)
    app.router.add_get("/proxy/stats", stats)
    app.on_cleanup.append(close)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvstore.integrations.vllm.proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill (kv_producer) vLLM server, http://HOST:PORT")
    ap.add_argument("--decode", required=True, help="the decode (kv_consumer) vLLM server, http://HOST:PORT")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    print(f"READY proxy on http://{a.host}:{a.port} prefill={a.prefill} decode={a.decode}", flush=True)
    web.run_app(make_app(a.prefill.rstrip("/"), a.decode.rstrip("/")), host=a.host, port=a.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
