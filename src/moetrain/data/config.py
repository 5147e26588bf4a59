"""Configuration of the training corpus, tokenizer and batching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.configlib import require, require_at_least


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from and how it becomes token windows.

    Fields:
        path: ``None`` for the default corpus (the running interpreter's standard-library ``.py`` files); else a
            file, a directory or a glob. Text: plain files (one document each), JSON lines (``.jsonl``, ``.json``),
            parquet (``.parquet``) and Arrow (``.arrow``) files of records, each optionally compressed (``.gz``,
            ``.zst``), or a Hugging Face ``datasets`` folder (``save_to_disk``). Pre-tokenized: a Megatron-Core
            indexed dataset (``prefix.bin`` + ``prefix.idx``; the prefix or either file) or a flat binary of token
            ids (``.bin``, with ``token_dtype``). Formats: data/formats.py, docs/data.md.
        text_field: the record field (JSON key, parquet / Arrow / ``datasets`` column) that holds a document's text.
        tokenizer: a pretrained tokenizer to use instead of training one: a ``tokenizer.json`` or a Hugging Face
            tokenizer folder holding one; it must have an ``<|endoftext|>`` token. Required for pre-tokenized input
            (the tokenizer its ids were made with).
        token_dtype: element type of a flat binary of token ids (``uint16`` for nanoGPT's GPT-2 ``train.bin``);
            ``None`` for every other format (a Megatron ``.idx`` states its own; when given it must agree).
        seq_len: tokens per training sequence.
        val_fraction: share of files held out for validation (split by file, at least one file).
        tokenizer_max_bytes: the BPE tokenizer is trained on at most this many bytes of the training split.
        cache_dir: where tokenizers and token memmaps are cached (``None``: ``$MOETRAIN_CACHE`` or
            ``~/.cache/moetrain``).
        packing: ``windows``: fixed windows of ``seq_len`` tokens cut from the token stream across document
            boundaries; ``documents``: whole documents (chunks of ``seq_len`` for longer ones) packed into rows
            with document-masked attention and positions restarting per document (data/packing.py); needed by
            ``train.tokens_per_batch``.
        workers: DataLoader worker processes that build batches in the background (0: in the training process);
            batches come out in the same order either way, so resuming is exact (data/loader.py).
        prefetch: batches each worker keeps ready (DataLoader's ``prefetch_factor``; used when ``workers > 0``).
    """

    path: str | None = None
    text_field: str = "text"
    tokenizer: str | None = None
    token_dtype: Literal["uint8", "uint16", "int16", "uint32", "int32", "int64"] | None = None
    seq_len: int = 256
    val_fraction: float = 0.01
    tokenizer_max_bytes: int = 16_000_000
    cache_dir: str | None = None
    packing: Literal["windows", "documents"] = "windows"
    workers: int = 0
    prefetch: int = 2

    def __post_init__(self) -> None:
        # An empty path would be read as the current directory (`--data "$CORPUS"` with the variable unset).
        require(self.path is None or bool(self.path.strip()), "path",
                f"is empty ({self.path!r}); give a file, directory or glob, or null for the default corpus")
        require(bool(self.text_field), "text_field", "is empty; name the field that holds the text (default 'text')")
        require(self.tokenizer is None or bool(self.tokenizer.strip()), "tokenizer",
                f"is empty ({self.tokenizer!r}); give a tokenizer.json or a tokenizer folder, or null to train one")
        require_at_least(self, 2, "seq_len")
        require(0 < self.val_fraction < 1, "val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        require_at_least(self, 0, "workers")
        require_at_least(self, 1, "prefetch", "tokenizer_max_bytes")
