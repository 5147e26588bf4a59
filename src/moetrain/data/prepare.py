"""Building one cache entry: a corpus streamed, split, tokenized on all cores and written as token files (its three
passes over the documents, their memory and speed: docs/data.md, "Preparation").

n = documents in the corpus; memory is O(n) small records (a 16-byte name digest and a size per document, an 8-byte
offset per document in the index) plus the tokenizer sample and a few batches of ``_ENCODE_CHUNK_CHARS``. Written:
``train.bin`` / ``val.bin`` (each document followed by EOS) with an index of document ends (``train.idx`` /
``val.idx``, little-endian int64, exclusive end offsets in tokens). Pre-tokenized documents are copied, not encoded.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from moetrain.data.config import DataConfig
from moetrain.data.corpus import (
    Document,
    ReadStats,
    digest_rows,
    iter_documents,
    name_digest,
    read_stats,
    split_only,
)
from moetrain.data.formats import Pretokenized, TokenDocument, iter_token_documents
from moetrain.data.tokenizer import EOS_TOKEN, train_tokenizer

# Bump when the cache layout or the tokenization changes, so old entries are never trusted.
CACHE_VERSION = 2
# Text per encode_batch call (~1M tokens): bounds the memory of the Encoding objects, which cost ~100 bytes per
# token, whatever the corpus size; larger chunks are no faster.
_ENCODE_CHUNK_CHARS = 4_000_000
# Batches the reading thread keeps ready ahead of the encoder (each up to _ENCODE_CHUNK_CHARS characters).
_READ_AHEAD = 2
# Pre-tokenized ids copied per write.
_COPY_CHUNK_TOKENS = 1 << 24


class Corpus:
    """How to stream one corpus's documents (text files and records, or pre-tokenized ids).

    Args:
        files: the corpus files (``discover_files``, or the pre-tokenized input's files).
        cfg: the data config (``text_field``, ``token_dtype``).
        pretokenized: the pre-tokenized input, or ``None`` for text.
        tokenizer: the given tokenizer (required for pre-tokenized input: its EOS and vocabulary size).
    """

    def __init__(self, files: Sequence[Path], cfg: DataConfig, pretokenized: Pretokenized | None,
                 tokenizer: Tokenizer | None):
        self.files, self.cfg, self.pretokenized, self.tokenizer = list(files), cfg, pretokenized, tokenizer

    def documents(self, counts: ReadStats) -> Iterator[Document | TokenDocument]:
        """The documents in corpus order; skipped ones counted in ``counts``."""
        if self.pretokenized is None:
            yield from iter_documents(self.files, self.cfg.text_field, counts)
            return
        assert self.tokenizer is not None  # prepare_data requires one for pre-tokenized input
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        assert eos is not None  # load_tokenizer checked it
        yield from iter_token_documents(self.pretokenized, self.cfg.token_dtype, eos,
                                        self.tokenizer.get_vocab_size(), counts)


def size_of(doc: Document | TokenDocument) -> int:
    """UTF-8 bytes of a text document, token ids of a pre-tokenized one."""
    return len(doc.text.encode()) if isinstance(doc, Document) else len(doc.ids)


@dataclass
class Scan:
    """What the first pass learned.

    Fields:
        digests: [n, 2] uint64 name digests (:func:`~moetrain.data.corpus.digest_rows`).
        sizes: [n] int64 :func:`size_of` each document.
        stats: the read statistics.
        only: the document itself when n == 1 (a one-document corpus is split inside the document).
    """

    digests: np.ndarray
    sizes: np.ndarray
    stats: ReadStats
    only: Document | TokenDocument | None


def scan(corpus: Corpus, source: str) -> Scan:
    """Pass 1. Raises ``DataError`` when no document is usable (see :func:`~moetrain.data.corpus.read_stats`)."""
    counts, digests, sizes = ReadStats(), bytearray(), array("q")
    first = None
    with tqdm(desc="data: scanning", unit="B", unit_scale=True, disable=None, mininterval=1.0) as bar:
        for doc in corpus.documents(counts):
            if first is None:
                first = doc
            digests += name_digest(doc.name)
            sizes.append(size_of(doc))
            bar.update(sizes[-1])
    stats = read_stats(corpus.files, len(sizes), counts, source)
    return Scan(digest_rows(bytes(digests)), np.frombuffer(sizes, dtype=np.int64) if sizes else
                np.zeros(0, np.int64), stats, first if len(sizes) == 1 else None)


def _cut_text(text: str, limit: int | None) -> str:
    # a cut may split a multibyte character: drop it
    return text if limit is None else text.encode()[:limit].decode("utf-8", errors="ignore")


def collect_sample(corpus: Corpus, found: Scan, val: np.ndarray, max_bytes: int) -> list[str]:
    """Pass 2: the tokenizer sample of a corpus of n > 1 documents, read from the stream: training documents in the
    order ``default_rng(0).permutation(n_train)`` until ``max_bytes`` (``data.tokenizer_max_bytes``) are taken, the
    last one cut to fit, so that a budget smaller than the corpus still sees all of it (not only the alphabetically
    first files)."""
    train = np.flatnonzero(~val)
    plan: list[tuple[int, int | None]] = []  # (document, byte limit or None) in sample order
    used = 0
    for i in train[np.random.default_rng(0).permutation(len(train))].tolist():
        if used >= max_bytes:
            break
        size = int(found.sizes[i])
        cut = max_bytes - used if size > max_bytes - used else None
        plan.append((i, cut))
        used += size if cut is None else cut
    wanted = dict(plan)
    texts: dict[int, str] = {}
    for i, doc in enumerate(corpus.documents(ReadStats())):
        if i in wanted:
            assert isinstance(doc, Document)  # a tokenizer is trained for text input only
            texts[i] = _cut_text(doc.text, wanted[i])
            if len(texts) == len(wanted):
                break  # closes the stream
    return [texts[i] for i, _ in plan]


def train_on_corpus(corpus: Corpus, found: Scan, val: np.ndarray | None, cfg: DataConfig, vocab_size: int,
                    log: Callable[[str], None]) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the training split's sample; logs its size and time."""
    t0 = time.perf_counter()
    if found.only is not None:  # the sample is the one document's training part, cut to the budget
        sample = [_cut_text(split_only(found.only, cfg.val_fraction)[0].text, cfg.tokenizer_max_bytes)]
    else:
        assert val is not None
        sample = collect_sample(corpus, found, val, cfg.tokenizer_max_bytes)
    tok = train_tokenizer(sample, vocab_size)
    log(f"data: trained a {tok.get_vocab_size()}-token byte-level BPE tokenizer on "
        f"{sum(len(t.encode()) for t in sample) / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
    return tok


class _SplitWriter:
    """The token file and document index of one split (in a staging directory: see ``dataset._build_entry``)."""

    def __init__(self, entry: Path, split: str, dtype: np.dtype, files: ExitStack):
        self.dtype = dtype
        self.file = files.enter_context(open(entry / f"{split}.bin", "wb"))
        self.index = files.enter_context(open(entry / f"{split}.idx", "wb"))
        self.tokens = 0
        self.documents = 0

    def write(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``ids`` [N] (documents each followed by EOS) whose documents are ``lengths`` [d] long."""
        self.file.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.index.write((self.tokens + np.cumsum(lengths, dtype=np.int64)).astype("<i8").tobytes())
        self.tokens += int(len(ids))
        self.documents += len(lengths)


def _read_ahead(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """``items`` produced by a background thread, up to ``depth`` ahead (the reader parses JSON and decompresses
    while the encoder, which releases the GIL, runs); its exception is raised here."""
    end = object()
    pool = ThreadPoolExecutor(1, thread_name_prefix="moetrain-data-reader")  # one thread: next() calls in order
    try:
        ahead = deque(pool.submit(next, items, end) for _ in range(depth))
        while (item := ahead.popleft().result()) is not end:
            ahead.append(pool.submit(next, items, end))
            yield item
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _batches(docs: Iterator[Document | TokenDocument], val: np.ndarray | None, sizes: np.ndarray, only: bool,
             val_fraction: float, limit: int) -> Iterator[tuple[str, list[Any], int]]:
    """``(split, documents, input size)`` batches of one split each, about ``limit`` characters (or ids) each,
    in corpus order within a split."""
    pending: dict[str, tuple[list[Any], int, int]] = {"train": ([], 0, 0), "val": ([], 0, 0)}
    for i, doc in enumerate(docs):
        if only:
            train_part, val_part = split_only(doc, val_fraction)
            parts = [("train", train_part)] + ([("val", val_part)] if val_part is not None else [])
        else:
            assert val is not None
            parts = [("val" if val[i] else "train", doc)]
        for k, (split, part) in enumerate(parts):
            batch, chars, nbytes = pending[split]
            batch.append(part)
            chars += len(part.text) if isinstance(part, Document) else len(part.ids)
            nbytes += int(sizes[i]) if k == 0 else 0
            if chars >= limit:
                yield split, batch, nbytes
                batch, chars, nbytes = [], 0, 0
            pending[split] = (batch, chars, nbytes)
    for split, (batch, _, nbytes) in pending.items():
        if batch:
            yield split, batch, nbytes


def write_splits(entry: Path, corpus: Corpus, found: Scan, val: np.ndarray | None, tok: Tokenizer, eos_id: int,
                 dtype: np.dtype, val_fraction: float) -> dict[str, tuple[int, int]]:
    """Pass 3: tokenize (or copy) every document into ``entry``'s ``train`` / ``val`` token files and indexes.

    Returns:
        ``{split: (documents, tokens)}``.
    """
    pretokenized = corpus.pretokenized is not None
    limit = _COPY_CHUNK_TOKENS if pretokenized else _ENCODE_CHUNK_CHARS
    # encode_batch_fast (tokenizers >= 0.20) gives the same ids as encode_batch without computing offsets: ~1.5x
    # faster on 2 cores.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    desc, unit = ("data: copying", "tok") if pretokenized else ("data: tokenizing", "B")
    with ExitStack() as files, tqdm(total=int(found.sizes.sum()), desc=desc, unit=unit, disable=None,
                                    unit_scale=True, mininterval=1.0, smoothing=0.1) as bar:
        writers = {split: _SplitWriter(entry, split, dtype, files) for split in ("train", "val")}
        stream = _batches(corpus.documents(ReadStats()), val, found.sizes, found.only is not None, val_fraction, limit)
        for split, batch, nbytes in _read_ahead(stream, _READ_AHEAD):
            pieces: list[Any]  # [documents] id arrays or lists
            if pretokenized:
                pieces = [np.asarray(d.ids) for d in batch]
            else:
                pieces = [e.ids for e in encode([d.text for d in batch], add_special_tokens=False)]
            lengths = np.fromiter((len(p) + 1 for p in pieces), dtype=np.int64, count=len(pieces))
            ids = np.empty(int(lengths.sum()), dtype=dtype)  # [tokens] documents, each followed by EOS
            ends = np.cumsum(lengths)
            ids[ends - 1] = eos_id
            for p, end, n in zip(pieces, ends.tolist(), lengths.tolist()):
                ids[end - n : end - 1] = p
            writers[split].write(ids, lengths)
            bar.update(nbytes)
    return {split: (w.documents, w.tokens) for split, w in writers.items()}
