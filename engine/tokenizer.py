"""Tokenizers: a built-in byte-level one, and a model folder's ``tokenizer.json`` through the
``tokenizers`` package when the folder has one.

Byte-level ids: 0..255 are the UTF-8 bytes themselves, then specials (``<bos>`` 256,
``<eos>`` 257, ``<pad>`` 258); ids above that up to the vocabulary size are reserved and decode
to nothing. Any text round-trips: ``decode(encode(s)) == s``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from engine.errors import InvalidModelFolder

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    BOS, EOS, PAD = 256, 257, 258
    NUM_SPECIALS = 3

    def __init__(self, vocab_size: int = 320) -> None:
        if vocab_size < 256 + self.NUM_SPECIALS:
            raise InvalidModelFolder(f"a byte tokenizer needs a vocabulary of at least 259, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id: int | None = self.BOS
        self.eos_token_id: int | None = self.EOS
        self.pad_token_id = self.PAD

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Specials and reserved ids are dropped; invalid UTF-8 (a cut multi-byte character)
        becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package (BPE, Unigram, WordPiece ...)."""

    def __init__(self, path: str | Path, bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(folder: str | Path | None, vocab_size: int = 320) -> Tokenizer:
    """``folder/tokenizer.json`` if present, else the byte tokenizer.

    A folder that has a ``tokenizer.json`` is refused when ``tokenizers`` is not installed
    (falling back to bytes would feed the model ids it was not trained on). BOS/EOS ids come
    from the folder's ``config.json`` when it names them.
    """
    path = Path(folder) / TOKENIZER_FILE if folder is not None else None
    if path is None or not path.exists():
        return ByteTokenizer(vocab_size)
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise InvalidModelFolder(f"{path} needs the 'tokenizers' package (pip install tokenizers)") from None
    bos = eos = None
    config = Path(folder) / "config.json"  # type: ignore[arg-type]
    if config.exists():
        raw = json.loads(config.read_text())
        bos, eos = raw.get("bos_token_id"), raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
    return HFTokenizer(path, bos, eos)
