"""The built-in byte tokenizer, and a folder's tokenizer.json through the ``tokenizers`` package."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine_testlib import single_threaded_torch, tiny_model  # noqa: E402, F401

from engine.errors import InvalidModelFolder  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: E402

TEXTS = ["", "hello", "héllo wörld", "日本語のテキスト", "emoji 🦙🚀 mixed\n\ttabs", "\x00 nul and \u202e bidi"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_utf8(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=True) + [tok.EOS, 300]) == text  # specials decode to nothing


def test_byte_tokenizer_specials_and_limits():
    tok = ByteTokenizer(320)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # a cut character does not raise
    with pytest.raises(InvalidModelFolder, match="at least 259"):
        ByteTokenizer(100)


def test_folder_without_tokenizer_json_uses_bytes(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def _train_tokenizer_json(path, vocab_size: int = 300) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50 + TEXTS, trainer=trainer)
    tok.save(str(path))


def test_folder_tokenizer_json_is_used_through_tokenizers(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    _train_tokenizer_json(tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size <= tiny_model().config.vocab_size
    text = "the quick brown fox, héllo 🦙"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges happened: not the byte tokenizer
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True)[0] == tok.bos_token_id == 256
    engine = LLMEngine.from_pretrained(tmp_path)
    assert isinstance(engine.tokenizer, HFTokenizer)
    by_text = engine.generate([text], max_tokens=4, ignore_eos=True)
    assert by_text == engine.generate([ids], max_tokens=4, ignore_eos=True)
