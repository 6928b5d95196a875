"""Log lines: key=value text with the request context appended, or one JSON object per line."""

from __future__ import annotations

import json
import logging

from kvstore.logs import JsonFormatter, TextFormatter, _ContextFilter, request_context


def _record(msg: str, *args) -> logging.LogRecord:  # noqa: ANN002
    rec = logging.LogRecord("kvstore.meta", logging.INFO, __file__, 1, msg, args, None)
    _ContextFilter().filter(rec)
    return rec


def test_json_lines_carry_pairs_and_request_context():
    token = request_context.set((("rpc", "PutCommit"), ("request_id", "a-1"), ("put_id", 42)))
    try:
        rec = _record("event=rpc_failed code=%s reason=%r blocks=%d", "NOT_FOUND", "put 42 is unknown", 3)
    finally:
        request_context.reset(token)
    out = json.loads(JsonFormatter().format(rec))
    assert out["event"] == "rpc_failed" and out["code"] == "NOT_FOUND" and out["blocks"] == 3
    assert out["reason"] == "put 42 is unknown"
    assert (out["rpc"], out["request_id"], out["put_id"]) == ("PutCommit", "a-1", 42)
    assert out["level"] == "info" and out["logger"] == "kvstore.meta"


def test_text_lines_append_context_only_inside_a_request():
    plain = TextFormatter().format(_record("event=started port=%d", 7100))
    assert plain.endswith("kvstore.meta event=started port=7100")
    token = request_context.set((("rpc", "Lookup"), ("request_id", "b-2")))
    try:
        line = TextFormatter().format(_record("event=x"))
    finally:
        request_context.reset(token)
    assert line.endswith("event=x rpc=Lookup request_id=b-2")
