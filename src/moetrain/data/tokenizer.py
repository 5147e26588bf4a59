"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``), GPT-2 style.

Byte-level means every byte sequence encodes and ``decode(encode(s)) == s`` for any string: no unknown token, no
normalisation, whitespace and unicode kept exactly. ``encode`` / ``decode`` are the ``Tokenizer``'s own
(``tok.encode(s).ids``, ``tok.decode(ids)``); no special tokens are added when encoding.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moetrain.errors import ConfigError, DataError

EOS_TOKEN = "<|endoftext|>"
"""Appended after every document; id 0."""

# 256 byte tokens + EOS: the smallest vocabulary a byte-level tokenizer can have.
MIN_VOCAB_SIZE = 257


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``.

    Args:
        texts: training text, e.g. documents; consumed once.
        vocab_size: target size including the 256 byte tokens and ``EOS_TOKEN`` (id 0). A tiny corpus may run
            out of merges first, so the result can be smaller; it is never larger.
    Returns:
        The tokenizer; deterministic for the same ``texts`` and ``vocab_size``.
    Raises:
        ConfigError: ``vocab_size < 257``.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"model.vocab_size: must be >= {MIN_VOCAB_SIZE} for a byte-level tokenizer "
                          f"(256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would break the exact round trip of text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == 0
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer saved with ``Tokenizer.save`` (a ``tokenizer.json``).

    Raises:
        DataError: the file is missing, unreadable, not a tokenizer, or has no ``EOS_TOKEN``.
    """
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for I/O and parse errors alike
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot load tokenizer '{path}': {reason}") from None
    if tok.token_to_id(EOS_TOKEN) is None:
        raise DataError(f"tokenizer '{path}' has no {EOS_TOKEN} token")
    return tok


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` that ``data.tokenizer`` names: the file itself, or the one in a Hugging Face tokenizer
    folder (``save_pretrained`` of a fast tokenizer, or a model repository's snapshot).

    Raises:
        DataError: the path does not exist, or is a folder without a ``tokenizer.json`` (a slow, SentencePiece-only
            tokenizer: save it with ``AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`` first).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise DataError(f"data.tokenizer: folder '{path}' has no tokenizer.json (a slow or SentencePiece-only "
                            f"tokenizer); convert it with transformers: "
                            f"AutoTokenizer.from_pretrained(folder).save_pretrained(folder)")
        return p / "tokenizer.json"
    if not p.is_file():
        raise DataError(f"data.tokenizer: '{path}' does not exist (give a tokenizer.json or a folder holding one)")
    return p
