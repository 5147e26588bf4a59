"""Configuration of the training corpus, tokenizer and batching."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.configlib import require


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from and how it becomes token windows.

    Fields:
        path: ``None`` for the default corpus (the running interpreter's standard-library ``.py`` files); else a
            text file, a directory or glob of text files, or a ``.jsonl`` file with a ``text`` field.
        seq_len: tokens per training sequence.
        val_fraction: share of files held out for validation (split by file, at least one file).
        tokenizer_max_bytes: the BPE tokenizer is trained on at most this many bytes of the training split.
        cache_dir: where tokenizers and token memmaps are cached (``None``: ``$MOETRAIN_CACHE`` or
            ``~/.cache/moetrain``).
    """

    path: str | None = None
    seq_len: int = 256
    val_fraction: float = 0.01
    tokenizer_max_bytes: int = 16_000_000
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        require(self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len}")
        require(0 < self.val_fraction < 1, "val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        require(self.tokenizer_max_bytes >= 1, "tokenizer_max_bytes", f"must be >= 1, got {self.tokenizer_max_bytes}")
