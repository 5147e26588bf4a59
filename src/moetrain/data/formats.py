"""Corpus formats: each file (or folder) of a corpus read as a stream of documents, in bounded memory (the formats,
their document names and their errors: docs/data.md, "Corpus formats").

Text formats give ``(name, text)`` documents, pre-tokenized ones :class:`TokenDocument`. Megatron-Core's indexed
dataset is read with numpy from the layout of ``megatron.core.datasets.indexed_dataset`` (``_IndexWriter``) and
tested against its own ``IndexedDatasetBuilder`` and ``IndexedDataset`` (tests/test_data_formats.py).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.errors import DataError

COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# A file with a NUL byte in its first 8 KiB is binary (the heuristic git and grep use).
BINARY_PROBE_BYTES = 8192
# Rows per batch when reading a `datasets` folder (its Arrow table is memory-mapped; a batch is a zero-copy slice).
_DATASETS_BATCH_ROWS = 4096
# Tokens per block when a flat binary is cut at its end-of-text tokens (64 MiB of uint16 ids).
_FLAT_BLOCK_TOKENS = 1 << 25

# Megatron-Core's indexed dataset (megatron/core/datasets/indexed_dataset.py): the .idx header, then
# version <Q (1), dtype code <B, sequence count <Q, document count <Q, int32 sequence lengths, int64 sequence byte
# offsets into the .bin, int64 document indices (sequence index where each document starts; first 0, last the count).
MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}


@dataclass(frozen=True)
class TokenDocument:
    """One pre-tokenized document.

    Fields:
        name: ``<file stem>:<document number>`` (1-based), unique within the corpus.
        ids: [n] integer token ids (a read-only view of a memmap; n >= 1), without a trailing end-of-text token.
    """

    name: str
    ids: np.ndarray


@dataclass
class ReadStats:
    """What reading a corpus kept and skipped, counted while its documents stream.

    Fields:
        files: files given.
        documents: documents kept.
        binary: files skipped as binary (a NUL byte in the first 8 KiB) or not valid UTF-8.
        unreadable: files skipped because they could not be read (permissions, vanished, a directory).
        empty: files (or records) skipped because their text is empty.
        bad_lines: records skipped: a JSON line that is invalid JSON or has no string text field, a null text.
    """

    files: int = 0
    documents: int = 0
    binary: int = 0
    unreadable: int = 0
    empty: int = 0
    bad_lines: int = 0

    @property
    def skipped(self) -> int:
        """Files and records skipped, for any reason."""
        return self.binary + self.unreadable + self.empty + self.bad_lines

    def describe(self) -> str:
        """``'3 skipped (2 binary, 1 unreadable)'``; ``'0 skipped'`` when nothing was."""
        parts = [f"{n} {what}" for n, what in ((self.binary, "binary"), (self.unreadable, "unreadable"),
                                                (self.empty, "empty"), (self.bad_lines, "bad records")) if n]
        return f"{self.skipped} skipped" + (f" ({', '.join(parts)})" if parts else "")


# -- names and compression ------------------------------------------------------------------------------------------

def compression_of(path: Path) -> str | None:
    """``'.gz'``, ``'.zst'`` / ``'.zstd'`` or ``None``, from the file name."""
    return path.suffix if path.suffix in COMPRESSION_SUFFIXES else None


def inner_suffix(path: Path) -> str:
    """The format suffix under any compression suffix: ``rows.jsonl.zst`` -> ``.jsonl``."""
    return Path(path.stem).suffix if compression_of(path) else path.suffix


def record_stem(name: str) -> str:
    """``name`` without its compression and record-format suffixes: ``dir/rows.jsonl.zst`` -> ``dir/rows``."""
    for suffixes in (COMPRESSION_SUFFIXES, RECORD_SUFFIXES):
        for s in suffixes:
            if name.endswith(s) and len(name) > len(s):
                name = name[: -len(s)]
                break
    return name


def open_stream(path: Path) -> io.BufferedIOBase:
    """``path`` opened for binary reading, decompressed as a stream when it is ``.gz`` / ``.zst``."""
    kind = compression_of(path)
    if kind == ".gz":
        return gzip.open(path, "rb")
    if kind in (".zst", ".zstd"):
        return io.BufferedReader(_ZstdReader(path), buffer_size=1 << 20)
    return open(path, "rb")


class _ZstdReader(io.RawIOBase):
    """A zstandard file decompressed as a stream, frame after frame (``zstd -c a b > c`` and pzstd write several),
    that raises on a file ending inside a frame: zstandard's own ``stream_reader`` returns a truncated file's
    decodable part without an error."""

    def __init__(self, path: Path):
        import zstandard  # a core dependency; imported here because most corpora are not zstd

        self._zstd = zstandard
        self._file = open(path, "rb")
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._fed = False  # the current frame has received input
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._pos == len(self._out):
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._fed:
                    raise self._zstd.ZstdError("the file ends inside a zstd frame")
                return 0
            out = []
            while chunk:
                out.append(self._frame.decompress(chunk))
                self._fed = True
                if not self._frame.eof:
                    break
                chunk = self._frame.unused_data  # the next frame
                self._frame, self._fed = self._decompressor.decompressobj(), False
            self._out, self._pos = b"".join(out), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _read_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean a file's bytes are damaged (truncated gzip / zstd stream, bad parquet / Arrow); imported
    only when an exception is being matched."""
    import pyarrow as pa
    import zstandard

    return EOFError, gzip.BadGzipFile, OSError, zstandard.ZstdError, pa.ArrowException


# -- text documents -------------------------------------------------------------------------------------------------

def is_datasets_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or ``DatasetDict``)."""
    return path.is_dir() and ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def iter_text_documents(path: Path, name: str, text_field: str, counts: ReadStats) -> Iterator[tuple[str, str]]:
    """The ``(name, text)`` documents of one corpus file (or ``datasets`` folder), in order; skips are counted.

    Args:
        path: the file or folder.
        name: its path relative to the corpus root (posix); whole-file documents keep it, records get
            ``<record_stem(name)>:<n>``.
        text_field: the record field holding the text.
        counts: incremented for what is skipped.
    Raises:
        DataError: a record file without the text field anywhere (a missing column, or no line with it), a column
            that is not text, or a file that is truncated or corrupt.
    """
    try:
        suffix = inner_suffix(path)
        if path.is_dir() or suffix in (".parquet", ".arrow"):
            yield from _columns(path, record_stem(name), text_field, counts)
        elif suffix == ".jsonl" or (suffix == ".json" and _first_line_is_record(path, text_field)):
            yield from _json_lines(path, record_stem(name), text_field, counts)
        else:
            yield from _whole_file(path, name, counts)
    except DataError:
        raise
    except (PermissionError, FileNotFoundError, IsADirectoryError):
        counts.unreadable += 1  # counted, not fatal
    except _read_errors() as e:
        if isinstance(e, OSError) and not compression_of(path) and inner_suffix(path) not in (".parquet", ".arrow"):
            counts.unreadable += 1  # another I/O error on a plain file
            return
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"'{path}' is truncated or corrupt ({reason}); re-download or re-write it, or remove it "
                        f"from data.path") from None


def _whole_file(path: Path, name: str, counts: ReadStats) -> Iterator[tuple[str, str]]:
    with open_stream(path) as f:
        raw = f.read()
    try:  # None: binary or not UTF-8
        text = None if b"\0" in raw[:BINARY_PROBE_BYTES] else raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None:
        counts.binary += 1
    elif not text:
        counts.empty += 1
    else:
        yield name, text


def _first_line_is_record(path: Path, text_field: str) -> bool:
    """Whether the first line of a ``.json`` file is a JSON object with a string ``text_field`` (JSON lines)."""
    with open_stream(path) as f:
        line = f.readline()
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False
    return isinstance(record, dict) and isinstance(record.get(text_field), str)


def _json_lines(path: Path, stem: str, text_field: str, counts: ReadStats) -> Iterator[tuple[str, str]]:
    """One document per line with a non-empty string field; lines split at ``\\n`` only (JSON keeps U+2028 raw)."""
    lines = bad = kept = 0
    with open_stream(path) as f:
        head = f.peek(BINARY_PROBE_BYTES)[:BINARY_PROBE_BYTES] if hasattr(f, "peek") else b""
        if b"\0" in head:
            counts.binary += 1
            return
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            lines += 1
            try:
                record = json.loads(raw)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                bad += 1
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                bad += 1
            elif not text:
                counts.empty += 1
            else:
                kept += 1
                yield f"{stem}:{lineno}", text
    counts.bad_lines += bad
    if not kept and bad:
        raise DataError(f"no usable text in '{path}': {bad} of {lines} lines are not JSON objects with a string "
                        f"'{text_field}' field (set data.text_field to the field that holds the text)")
    if not lines:
        counts.empty += 1


def _text_column(path: Path, schema: Any, text_field: str) -> None:
    """Raise when the Arrow ``schema`` has no string column ``text_field``."""
    import pyarrow as pa

    if text_field not in schema.names:
        raise DataError(f"'{path}' has no column '{text_field}' (columns: {', '.join(schema.names)}); set "
                        f"data.text_field to the column that holds the text")
    tp = schema.field(text_field).type
    if not (pa.types.is_string(tp) or pa.types.is_large_string(tp) or pa.types.is_string_view(tp)):
        raise DataError(f"'{path}': column '{text_field}' holds {tp}, not text (strings); set data.text_field to "
                        f"the column that holds the text")


def _columns(path: Path, stem: str, text_field: str, counts: ReadStats) -> Iterator[tuple[str, str]]:
    """One document per row of the ``text_field`` column of a parquet or Arrow file or a ``datasets`` folder, one
    record batch in memory at a time; a null text counts as a bad record."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with ExitStack() as files:
        if path.is_dir():
            ds = _datasets_split(path)
            schema, batches = ds.data.schema, ds.with_format("arrow").iter(batch_size=_DATASETS_BATCH_ROWS)
        elif inner_suffix(path) == ".parquet":
            pf = files.enter_context(pq.ParquetFile(path))
            schema = pf.schema_arrow
            batches = (pf.read_row_group(g, columns=[text_field]) for g in range(pf.num_row_groups))
        else:
            source = files.enter_context(pa.memory_map(str(path)))
            try:
                reader: Any = pa.ipc.open_stream(source)  # what datasets writes
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
            schema, batches = reader.schema, reader if isinstance(reader, pa.ipc.RecordBatchStreamReader) else \
                (reader.get_batch(i) for i in range(reader.num_record_batches))
        _text_column(path, schema, text_field)
        texts = (text for batch in batches for text in batch.column(text_field).to_pylist())
        for row, text in enumerate(texts, start=1):
            if text is None:
                counts.bad_lines += 1
            elif not text:
                counts.empty += 1
            else:
                yield f"{stem}:{row}", text


def _datasets_split(path: Path) -> Any:
    """The ``datasets.Dataset`` saved at ``path`` (a ``DatasetDict``'s ``train`` split)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"'{path}' is a Hugging Face datasets folder: install the 'datasets' package "
                        f"(pip install 'moetrain[data]')") from None
    ds: Any = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"'{path}' is a DatasetDict without a 'train' split (splits: {', '.join(ds)}); point "
                            f"data.path at the split's folder")
        ds = ds["train"]
    return ds


# -- pre-tokenized documents ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pretokenized:
    """A pre-tokenized corpus at ``data.path``.

    Fields:
        kind: ``'megatron'`` or ``'flat'``.
        files: the files it is read from (``[prefix.bin, prefix.idx]``, or ``[file.bin]``).
        name: the documents' name stem (the prefix's or file's name without ``.bin``).
    """

    kind: str
    files: tuple[Path, ...]
    name: str


def find_pretokenized(path: str | None) -> Pretokenized | None:
    """The pre-tokenized corpus ``path`` names, or ``None`` for text input.

    A Megatron indexed dataset is named by its prefix or either of its two files (both must exist); any other
    ``.bin`` file is a flat binary of token ids.
    """
    if path is None:
        return None
    p = Path(path).expanduser()
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    idx, binary = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    if idx.is_file() and binary.is_file() and (p.suffix in (".bin", ".idx") or not p.exists()):
        return Pretokenized("megatron", (binary, idx), prefix.name)
    if p.suffix == ".idx" and p.is_file():
        raise DataError(f"data path '{path}' is a Megatron index without its data file '{binary}'")
    if p.suffix == ".bin" and p.is_file():
        return Pretokenized("flat", (p,), prefix.name)
    return None


@dataclass(frozen=True)
class MegatronIndex:
    """The ``.idx`` of a Megatron-Core indexed dataset.

    Fields:
        dtype: the token dtype its header states.
        sequence_lengths: [sequences] int32 tokens per sequence.
        sequence_pointers: [sequences] int64 byte offset of each sequence in the ``.bin``.
        document_indices: [documents + 1] int64: document d is sequences ``[document_indices[d],
            document_indices[d + 1])``.
    """

    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @classmethod
    def read(cls, idx: Path, binary: Path) -> MegatronIndex:
        """Read and check ``idx`` against the size of ``binary``.

        Raises:
            DataError: not a Megatron index (header, version, dtype code), an index shorter than its counts say,
                or a ``.bin`` shorter than the index says (truncated).
        """
        with open(idx, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != MEGATRON_HEADER:
            raise DataError(f"'{idx}' is not a Megatron-Core indexed dataset index (no {MEGATRON_HEADER!r} header)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in MEGATRON_DTYPES:
            raise DataError(f"'{idx}': unsupported Megatron index version {version} or dtype code {code}")
        dtype = np.dtype(MEGATRON_DTYPES[code])
        if dtype.kind == "f":
            raise DataError(f"'{idx}' holds {dtype} values, not token ids")
        need = 34 + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if os.path.getsize(idx) < need:
            raise DataError(f"'{idx}' is truncated: {os.path.getsize(idx)} bytes, its header says at least {need}")
        mm = np.memmap(idx, mode="r", dtype=np.uint8)
        lengths = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=34)
        pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=34 + 4 * n_seq)
        docs = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=34 + 12 * n_seq)
        end = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if n_seq else 0
        size = os.path.getsize(binary)
        if size < end:
            raise DataError(f"'{binary}' is truncated: {size} bytes, its index '{idx.name}' needs {end} "
                            f"({n_seq} sequences of {dtype}); rebuild it or copy it again")
        return cls(dtype, lengths, pointers, docs)


def iter_token_documents(corpus: Pretokenized, token_dtype: str | None, eos_id: int, vocab_size: int,
                         counts: ReadStats) -> Iterator[TokenDocument]:
    """The documents of a pre-tokenized corpus, in order; empty ones are counted in ``counts.empty``.

    Args:
        corpus: from :func:`find_pretokenized`.
        token_dtype: ``data.token_dtype`` (required for a flat binary).
        eos_id: the tokenizer's end-of-text id: documents are cut at it in a flat binary; a Megatron document's
            trailing one is dropped.
        vocab_size: the tokenizer's vocabulary size; every id must be below it.
    Raises:
        DataError: a flat binary without ``token_dtype`` or whose size is not a multiple of it, a dtype that
            disagrees with the Megatron index, a truncated ``.bin``, or an id outside ``[0, vocab_size)``.
    """
    if corpus.kind == "megatron":
        binary, idx = corpus.files
        index = MegatronIndex.read(idx, binary)
        if token_dtype is not None and np.dtype(token_dtype) != index.dtype:
            raise DataError(f"data.token_dtype: '{token_dtype}' does not match '{idx}', which holds {index.dtype} ids")
        tokens = open_tokens(binary, index.dtype)
        starts = index.sequence_pointers // index.dtype.itemsize
        bounds = index.document_indices
        for d in range(len(bounds) - 1):
            s0, s1 = int(bounds[d]), int(bounds[d + 1])
            if s1 <= s0:
                counts.empty += 1
                continue
            # a document's sequences are consecutive in the .bin (the builder writes them in order)
            ids = tokens[int(starts[s0]) : int(starts[s1 - 1]) + int(index.sequence_lengths[s1 - 1])]
            if len(ids) and ids[-1] == eos_id:
                ids = ids[:-1]
            if not len(ids):
                counts.empty += 1
                continue
            _check_ids(ids, vocab_size, binary, int(starts[s0]), "")
            yield TokenDocument(f"{corpus.name}:{d + 1}", ids)
        return
    (path,) = corpus.files
    if token_dtype is None:
        raise DataError(f"data path '{path}' is a flat binary of token ids: set data.token_dtype to their type "
                        f"(uint16 for nanoGPT's GPT-2 train.bin)")
    dtype = np.dtype(token_dtype)
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise DataError(f"'{path}' has {size} bytes, not a whole number of {dtype} ids ({dtype.itemsize} bytes "
                        f"each): data.token_dtype is wrong or the file is truncated")
    tokens = open_tokens(path, dtype)
    hint = f"; is data.token_dtype={token_dtype} the type the file was written with?"
    doc, start = 1, 0
    for block in range(0, len(tokens), _FLAT_BLOCK_TOKENS):
        chunk = tokens[block : block + _FLAT_BLOCK_TOKENS]
        _check_ids(chunk, vocab_size, path, block, hint)
        for end in (block + np.flatnonzero(chunk == eos_id)).tolist():
            if end > start:
                yield TokenDocument(f"{corpus.name}:{doc}", tokens[start:end])
            else:
                counts.empty += 1
            doc, start = doc + 1, end + 1
    if start < len(tokens):  # a last document without an end-of-text token
        yield TokenDocument(f"{corpus.name}:{doc}", tokens[start:])


def open_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    """[N] read-only memmap of the ids in ``path``; np.memmap refuses empty files, so an empty one is a plain array."""
    return np.memmap(path, mode="r", dtype=dtype) if os.path.getsize(path) else np.zeros(0, dtype)


def _check_ids(ids: np.ndarray, vocab_size: int, path: Path, offset: int, hint: str) -> None:
    if not len(ids):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        at = offset + int(np.flatnonzero(ids == bad)[0])
        raise DataError(f"'{path}': token id {bad} at token {at:,} is outside the tokenizer's vocabulary of "
                        f"{vocab_size} (data.tokenizer must be the tokenizer these ids were made with{hint})")
