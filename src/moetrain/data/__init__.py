"""Corpus -> tokenizer -> cached token memmaps -> windows, resumable batches, eval batches.

One concept per module: :mod:`.formats` (reading each corpus format as a stream of documents), :mod:`.corpus`
(files, documents, split), :mod:`.tokenizer`, :mod:`.prepare` (streaming a corpus into a cache entry),
:mod:`.dataset` (cache, windows, sampling), :mod:`.config` (:class:`DataConfig`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names re-exported from the submodules, imported on first use (PEP 562): ``moetrain.data.config`` is read by the
# config checks, which must answer before torch (``.dataset``) is imported (a config error takes < 1 s).
_EXPORTS = {
    "DataConfig": "config", "Document": "corpus", "ReadStats": "formats", "default_corpus_files": "corpus",
    "discover_files": "corpus", "iter_documents": "corpus", "read_documents": "corpus", "split_documents": "corpus",
    "BatchSampler": "dataset", "PreparedData": "dataset", "TokenWindows": "dataset", "eval_batches": "dataset",
    "prepare_data": "dataset", "EOS_TOKEN": "tokenizer", "load_tokenizer": "tokenizer", "train_tokenizer": "tokenizer",
}

if TYPE_CHECKING:
    from moetrain.data.config import DataConfig
    from moetrain.data.corpus import (
        Document, default_corpus_files, discover_files, iter_documents, read_documents, split_documents,
    )
    from moetrain.data.dataset import BatchSampler, PreparedData, TokenWindows, eval_batches, prepare_data
    from moetrain.data.formats import ReadStats
    from moetrain.data.tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moetrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moetrain.data.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
