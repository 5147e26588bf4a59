"""Corpus -> tokenizer -> cached token memmaps -> windows, resumable batches, eval batches.

One concept per module: :mod:`.formats` (reading each corpus format as a stream of documents), :mod:`.corpus`
(files, documents, split), :mod:`.tokenizer`, :mod:`.prepare` (streaming a corpus into a cache entry),
:mod:`.dataset` (cache, windows, sampling), :mod:`.config` (:class:`DataConfig`).
"""

from moetrain.data.config import DataConfig
from moetrain.data.corpus import (
                                  Document,
                                  ReadStats,
                                  default_corpus_files,
                                  discover_files,
                                  iter_documents,
                                  read_documents,
                                  split_documents,
)
from moetrain.data.dataset import (
                                  BatchSampler,
                                  PreparedData,
                                  TokenWindows,
                                  eval_batches,
                                  prepare_data,
)
from moetrain.data.tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer

__all__ = [
    "EOS_TOKEN", "BatchSampler", "DataConfig", "Document", "PreparedData", "ReadStats", "TokenWindows",
    "default_corpus_files", "discover_files", "iter_documents", "eval_batches", "load_tokenizer", "prepare_data", "read_documents",
    "split_documents", "train_tokenizer",
]
