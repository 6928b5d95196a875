"""Logging of the servers: ``key=value`` lines, or one JSON object per line (``log.format``).

Log calls write ``event=name key=value ...`` messages. Inside an RPC handler (:mod:`kvstore.rpc`)
the record also carries the request's context: ``rpc`` (method), ``request_id`` (unique in the
process) and the request's ``put_id`` / ``lease_id`` where it has one, so that every line a
request causes can be found from its failure line. The JSON format turns the message's pairs
into fields.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from typing import Any

# The request being handled, as (name, value) pairs; empty outside a handler.
request_context: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "kvstore_request", default=()
)

_PAIR = re.compile(r"""(\w+)=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S+)""")


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.kv_context = request_context.get()
        return True


class TextFormatter(logging.Formatter):
    """``time LEVEL logger message [rpc=... request_id=...]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ctx = getattr(record, "kv_context", ())
        if ctx:
            head, sep, tail = line.partition("\n")  # keep a traceback below the line
            line = head + "".join(f" {k}={v}" for k, v in ctx) + sep + tail
        return line


def _value(raw: str) -> Any:
    if raw[:1] in "'\"":
        return raw[1:-1]
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the message's key=value pairs, the
    request's context, and ``exc`` with a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": msg,
        }
        for k, v in _PAIR.findall(msg):
            out.setdefault(k, _value(v))
        for k, v in getattr(record, "kv_context", ()):
            out.setdefault(k, v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "info", fmt: str = "text") -> None:
    """Configures the root logger of a server process (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
