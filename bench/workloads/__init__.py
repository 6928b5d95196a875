"""Request streams for the prefix-reuse benchmarks: synthetic workloads and trace replay.

Each workload yields :class:`Request` (arrival s, prompt token ids, output length) in arrival
order, deterministically from its arguments, and offers its block-key stream (per request, the
16-token block keys of its prompt in the benchmarks' fixed :data:`KEYSPACE`)::

    from bench.workloads import make
    w = make("chat", seed=0, scale=0.25, max_requests=500)
    for req in w.requests(): ...
    keys = w.block_keys()
"""

from __future__ import annotations

from bench.workloads.base import BLOCK_SIZE, KEYSPACE, VOCAB, Request, Workload
from bench.workloads.chat import Chat
from bench.workloads.docqa import DocQA
from bench.workloads.fewshot import FewShot
from bench.workloads.trace import Trace, find_trace

WORKLOADS: dict[str, type[Workload]] = {w.name: w for w in (Chat, DocQA, FewShot, Trace)}


def make(name: str, **kwargs) -> Workload:  # noqa: ANN003 - forwarded to the workload
    """A workload by name (``chat``, ``docqa``, ``fewshot``, ``trace``)."""
    try:
        cls = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}") from None
    return cls(**kwargs)


__all__ = [
    "BLOCK_SIZE",
    "KEYSPACE",
    "VOCAB",
    "WORKLOADS",
    "Chat",
    "DocQA",
    "FewShot",
    "Request",
    "Trace",
    "Workload",
    "find_trace",
    "make",
]
