"""Engine errors. Bad input is a ``ValueError`` (through ``kvstore.errors.InvalidArgument``, so a
server maps it to INVALID_ARGUMENT in one place) whose message names what is wrong."""

from __future__ import annotations

from kvstore.errors import InvalidArgument


class InvalidRequest(InvalidArgument):
    """A request the engine refuses (empty prompt, too long, token out of vocabulary, bad
    sampling parameters, more KV than the cache holds). Nothing was queued."""


class InvalidModelFolder(InvalidArgument):
    """A model folder that cannot be loaded (missing or mismatched files, unsupported config)."""
