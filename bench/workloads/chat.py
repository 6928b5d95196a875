"""Multi-turn chat: a shared system prompt, sessions whose history grows turn by turn."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from bench.workloads.base import Request, Workload, scaled, tokens


class Chat(Workload):
    """``sessions`` conversations starting at random times in ``[0, duration_s)``, interleaved.

    Every prompt is ``system + u1 + a1 + ... + u_k``: the shared system prompt, then the
    session's history (each earlier user turn and its answer), then the new user turn; the
    request's output is the answer ``a_k``, which the next turn's prompt carries. Turns of a
    session are ``think_s`` apart on average (exponential), so many sessions are active at once
    and a session's next turn finds its history behind other sessions' traffic.
    """

    name = "chat"

    def __init__(
        self,
        seed: int = 0,
        scale: float = 1.0,
        max_requests: int | None = None,
        max_time_s: float | None = None,
        quiet: bool = False,
        *,
        sessions: int = 400,
        duration_s: float = 3600.0,
        system_tokens: int = 2048,
        turns: tuple[int, int] = (2, 14),
        user_tokens: tuple[int, int] = (32, 512),
        answer_tokens: tuple[int, int] = (32, 384),
        think_s: float = 60.0,
    ) -> None:
        super().__init__(seed, scale, max_requests, max_time_s, quiet)
        self.sessions = sessions
        self.duration_s = duration_s
        self.system_tokens = scaled(system_tokens, scale)
        self.turns = turns
        self.user_tokens = (scaled(user_tokens[0], scale), scaled(user_tokens[1], scale))
        self.answer_tokens = (scaled(answer_tokens[0], scale), scaled(answer_tokens[1], scale))
        self.think_s = think_s

    def shape(self) -> str:
        return (
            f"{self.sessions} sessions of {self.turns[0]}-{self.turns[1]} turns over {self.duration_s:g} s, "
            f"system prompt {self.system_tokens} tokens, user turns {self.user_tokens[0]}-{self.user_tokens[1]}, "
            f"answers {self.answer_tokens[0]}-{self.answer_tokens[1]} tokens"
        )

    def _generate(self) -> Iterator[Request]:
        rng = np.random.default_rng([self.seed, 1])
        system = tokens(rng, self.system_tokens)
        plans = []  # per session: [(arrival, user turn, answer)]
        events = []
        for s in range(self.sessions):
            t = float(rng.uniform(0, self.duration_s))
            turns = []
            for k in range(int(rng.integers(self.turns[0], self.turns[1] + 1))):
                user = tokens(rng, rng.integers(self.user_tokens[0], self.user_tokens[1] + 1))
                answer = tokens(rng, rng.integers(self.answer_tokens[0], self.answer_tokens[1] + 1))
                turns.append((t, user, answer))
                events.append((t, s, k))
                t += float(rng.exponential(self.think_s))
            plans.append(turns)
        history: list[list[np.ndarray]] = [[system] for _ in range(self.sessions)]
        for t, s, k in sorted(events):
            _, user, answer = plans[s][k]
            parts = history[s]
            parts.append(user)
            yield Request(t, np.concatenate(parts), len(answer))
            parts.append(answer)
