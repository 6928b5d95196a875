"""Shared few-shot prefix: one long prefix in every request, then a short question of its own."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from bench.workloads.base import Request, Workload, scaled, tokens


class FewShot(Workload):
    """``requests_n`` requests arriving as a Poisson stream over ``duration_s``, each
    ``prefix + question``: the same few-shot prefix (instructions and worked examples), then a
    question that no other request shares."""

    name = "fewshot"

    def __init__(
        self,
        seed: int = 0,
        scale: float = 1.0,
        max_requests: int | None = None,
        max_time_s: float | None = None,
        quiet: bool = False,
        *,
        requests_n: int = 1500,
        duration_s: float = 3600.0,
        prefix_tokens: int = 6144,
        question_tokens: tuple[int, int] = (16, 256),
        answer_tokens: tuple[int, int] = (16, 256),
    ) -> None:
        super().__init__(seed, scale, max_requests, max_time_s, quiet)
        self.requests_n = requests_n
        self.duration_s = duration_s
        self.prefix_tokens = scaled(prefix_tokens, scale)
        self.question_tokens = (scaled(question_tokens[0], scale), scaled(question_tokens[1], scale))
        self.answer_tokens = (scaled(answer_tokens[0], scale), scaled(answer_tokens[1], scale))

    def shape(self) -> str:
        return (
            f"{self.requests_n} requests over {self.duration_s:g} s, prefix {self.prefix_tokens} tokens, "
            f"questions {self.question_tokens[0]}-{self.question_tokens[1]} tokens"
        )

    def _generate(self) -> Iterator[Request]:
        rng = np.random.default_rng([self.seed, 3])
        prefix = tokens(rng, self.prefix_tokens)
        arrivals = np.sort(rng.uniform(0, self.duration_s, self.requests_n))
        for t in arrivals.tolist():
            question = tokens(rng, rng.integers(self.question_tokens[0], self.question_tokens[1] + 1))
            out = int(rng.integers(self.answer_tokens[0], self.answer_tokens[1] + 1))
            yield Request(t, np.concatenate([prefix, question]), out)
