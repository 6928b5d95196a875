"""Long-document QA: documents of about 10k tokens, several questions about each, interleaved."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from bench.workloads.base import Request, Workload, scaled, tokens


class DocQA(Workload):
    """``docs`` documents arriving at random times in ``[0, duration_s)``; each is asked
    ``questions`` questions, ``gap_s`` apart on average (exponential), starting at its arrival.

    A prompt is ``header + document + question``: a short instruction shared by every request,
    the whole document, and a question of its own. Several documents are open at once, so a
    document's next question finds it behind other documents' traffic.
    """

    name = "docqa"

    def __init__(
        self,
        seed: int = 0,
        scale: float = 1.0,
        max_requests: int | None = None,
        max_time_s: float | None = None,
        quiet: bool = False,
        *,
        docs: int = 150,
        duration_s: float = 3600.0,
        header_tokens: int = 32,
        doc_tokens: tuple[int, int] = (8000, 12000),
        questions: tuple[int, int] = (2, 8),
        question_tokens: tuple[int, int] = (16, 128),
        answer_tokens: tuple[int, int] = (16, 256),
        gap_s: float = 45.0,
    ) -> None:
        super().__init__(seed, scale, max_requests, max_time_s, quiet)
        self.docs = docs
        self.duration_s = duration_s
        self.header_tokens = scaled(header_tokens, scale)
        self.doc_tokens = (scaled(doc_tokens[0], scale), scaled(doc_tokens[1], scale))
        self.questions = questions
        self.question_tokens = (scaled(question_tokens[0], scale), scaled(question_tokens[1], scale))
        self.answer_tokens = (scaled(answer_tokens[0], scale), scaled(answer_tokens[1], scale))
        self.gap_s = gap_s

    def shape(self) -> str:
        return (
            f"{self.docs} documents of {self.doc_tokens[0]}-{self.doc_tokens[1]} tokens over {self.duration_s:g} s, "
            f"{self.questions[0]}-{self.questions[1]} questions each of "
            f"{self.question_tokens[0]}-{self.question_tokens[1]} tokens, header {self.header_tokens} tokens"
        )

    def _generate(self) -> Iterator[Request]:
        rng = np.random.default_rng([self.seed, 2])
        header = tokens(rng, self.header_tokens)
        docs = []
        events = []
        for d in range(self.docs):
            t = float(rng.uniform(0, self.duration_s))
            doc = np.concatenate([header, tokens(rng, rng.integers(self.doc_tokens[0], self.doc_tokens[1] + 1))])
            asks = []
            for q in range(int(rng.integers(self.questions[0], self.questions[1] + 1))):
                question = tokens(rng, rng.integers(self.question_tokens[0], self.question_tokens[1] + 1))
                out = int(rng.integers(self.answer_tokens[0], self.answer_tokens[1] + 1))
                asks.append((question, out))
                events.append((t, d, q))
                t += float(rng.exponential(self.gap_s))
            docs.append((doc, asks))
        for t, d, q in sorted(events):
            doc, asks = docs[d]
            question, out = asks[q]
            yield Request(t, np.concatenate([doc, question]), out)
