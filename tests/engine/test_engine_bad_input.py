"""Bad requests are refused with an InvalidRequest (a ValueError) that names the problem, and
nothing is queued."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine_testlib import make_engine, single_threaded_torch  # noqa: E402, F401

from engine.errors import InvalidRequest  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ([], {}, "prompt is empty"),
        ("", {}, "prompt is empty"),
        (list(range(256)) * 4 + [1], {}, "prompt has 1025 tokens, more than max_position_embeddings=1024"),
        ([1, 2, 320], {}, "token id 320 at index 2 is outside the vocabulary \\[0, 320\\)"),
        ([-1], {}, "token id -1 at index 0 is outside the vocabulary"),
        ([1, 2.0], {}, "token at index 1 is 2.0, not an int"),
        ([1, True], {}, "token at index 1 is True, not an int"),
        (42, {}, "prompt must be a str or a sequence of token ids"),
        ([1], {"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
        ([1], {"max_tokens": 2.5}, "max_tokens must be an int >= 1"),
        ([1], {"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ([1], {"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ([1], {"seed": -3}, "seed must be None or a non-negative int"),
        (list(range(100)), {"max_tokens": 900}, "needs up to 63 KV blocks \\(999 tokens\\) but the cache has 8"),
    ],
)
def test_bad_requests_are_refused_by_name(prompt, kwargs, message):
    engine = make_engine(num_blocks=8)
    with pytest.raises(InvalidRequest, match=message) as info:
        engine.add_request(prompt, **kwargs)
    assert isinstance(info.value, ValueError)
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_generate_validates_every_prompt_before_running():
    engine = make_engine()
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.generate([[1, 2], []])
    assert not engine.has_unfinished()


def test_sampling_params_validate_on_their_own():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
