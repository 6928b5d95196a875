"""kvstore as vLLM's KV connector (:mod:`kvstore.integrations.vllm.connector`).

Load it with ``KVTransferConfig(kv_connector="KVStoreConnector",
kv_connector_module_path="kvstore.integrations.vllm", ...)``. The planning
(:mod:`~kvstore.integrations.vllm.plan`) and block copies (:mod:`~kvstore.integrations.vllm.blocks`)
import without vLLM; the connector itself needs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStoreConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreWorkerMetadata"):
        from kvstore.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
