"""Corpus files -> documents -> train / validation split.

Everything here is deterministic and independent of the machine: files are sorted by relative path, document
names are relative to the corpus root, and the validation split is chosen by a hash of those names.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.data.formats import ReadStats, TokenDocument, is_datasets_folder, iter_text_documents
from moetrain.errors import DataError

_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


@dataclass(frozen=True)
class Document:
    """One unit of text: a whole file, or one record (a JSON line, a parquet row) of a record file.

    Fields:
        name: path relative to the corpus root in posix form (``pkg/mod.py``); ``dir/file:12`` for record 12 of
            ``dir/file.jsonl`` (or ``.jsonl.zst``, ``.parquet``, ...: format and compression suffixes dropped, so
            the same rows in any format are the same documents). The same on every machine.
        text: the document's text (never empty).
    """

    name: str
    text: str


def default_corpus_files() -> list[Path]:
    """The running interpreter's standard-library ``.py`` files, sorted by relative posix path.

    Files under ``site-packages`` / ``dist-packages`` (installed third-party code) and hidden directories are
    excluded, so the corpus is the same for every venv built from one Python.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / rel for rel in _walk(root, lambda name: name.endswith(".py"), prune=_PACKAGE_DIRS)]


def discover_files(path: str | None) -> list[Path]:
    """The files that make up the corpus at ``path``.

    Args:
        path: ``None`` for :func:`default_corpus_files`; a file; a Hugging Face ``datasets`` folder (returned
            itself); a directory (every regular file below it,
            recursively, skipping hidden files and directories such as ``.git``); or a glob pattern
            (``**`` recursive; a matched directory contributes its files). ``~`` is expanded.
    Returns:
        Files sorted by path relative to the directory (or the glob's match list order), without duplicates.
    Raises:
        DataError: the path does not exist, or the glob or directory yields no files.
    """
    if path is None:
        files = default_corpus_files()
        if not files:
            raise DataError(f"default corpus: no .py files under '{sysconfig.get_paths()['stdlib']}'")
        return files
    target = Path(path).expanduser()
    if target.is_file() or is_datasets_folder(target):  # a `datasets` folder is read as a whole (data/formats.py)
        return [target]
    if target.is_dir():
        files = [target / rel for rel in _walk(target, lambda name: True)]
    elif glob.has_magic(path):
        files = []
        for match in sorted(glob.glob(os.path.expanduser(path), recursive=True)):
            m = Path(match)
            files += [m / rel for rel in _walk(m, lambda name: True)] if m.is_dir() else [m] if m.is_file() else []
        if not files:
            raise DataError(f"data path '{path}' does not exist (the glob matches no files)")
        files = list(dict.fromkeys(files))
    elif os.path.lexists(target):
        broken = target.is_symlink() and not target.exists()
        raise DataError(f"data path '{path}' " + ("is a broken symbolic link (its target is missing, or a loop)"
                                                  if broken else "is not a regular file or directory"))
    else:
        raise DataError(f"data path '{path}' does not exist")
    if not files:
        raise DataError(f"data path '{path}' contains no files")
    return files


def _walk(root: Path, keep: Callable[[str], bool], prune: frozenset[str] = frozenset()) -> list[str]:
    """Relative posix paths of the regular files below ``root`` whose name passes ``keep``, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in prune]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if not name.startswith(".") and keep(name) and os.path.isfile(os.path.join(dirpath, name)):
                found.append((rel_dir / name).as_posix())
    return sorted(found)


def corpus_root(files: Sequence[Path]) -> Path:
    """The common directory of ``files`` (absolute): document names are relative to it."""
    absolute = [Path(os.path.abspath(f)) for f in files]
    return Path(os.path.commonpath([f.parent for f in absolute])) if absolute else Path(".")


def iter_documents(files: Sequence[Path], text_field: str = "text",
                   counts: ReadStats | None = None) -> Iterator[Document]:
    """Stream the documents of ``files`` in order (data/formats.py reads each format), skipping what is not
    usable text; at most one record batch (a parquet row group, a line) is in memory beyond the document yielded.

    Args:
        files: from :func:`discover_files`.
        text_field: the record field that holds the text (``data.text_field``).
        counts: incremented for every file or record skipped, by reason.
    Raises:
        DataError: see :func:`~moetrain.data.formats.iter_text_documents` (a missing column, a truncated file).
    """
    counts = counts if counts is not None else ReadStats()
    root = corpus_root(files)
    for f in files:
        f = Path(os.path.abspath(f))
        for name, text in iter_text_documents(f, _name(f.relative_to(root)), text_field, counts):
            yield Document(name, text)


def read_documents(files: Sequence[Path], source: str | None = None,
                   text_field: str = "text") -> tuple[list[Document], ReadStats]:
    """Read ``files`` into a list of documents, in order (:func:`iter_documents`, all in memory).

    Args:
        files: from :func:`discover_files`.
        source: how error messages name the corpus (default: the common directory of ``files``).
        text_field: the record field that holds the text.
    Returns:
        ``(documents, stats)``; document names are relative to the common directory of ``files``.
    Raises:
        DataError: nothing usable remains (the message counts the skipped files by reason); or a record file
            without the text field.
    """
    counts = ReadStats()
    docs = list(iter_documents(files, text_field, counts))
    return docs, read_stats(files, len(docs), counts, source)


def read_stats(files: Sequence[Path], documents: int, counts: ReadStats, source: str | None = None) -> ReadStats:
    """``counts`` of a finished read, with its files and documents.

    Raises:
        DataError: no document was read (the message counts the skipped files by reason).
    """
    counts.files, counts.documents = len(files), documents
    if not documents:
        where = source if source is not None else str(corpus_root(files))
        raise DataError(f"no usable text in '{where}': {len(files)} files, {counts.describe()}")
    return counts


def _name(rel: Path) -> str:
    """``rel`` in posix form; bytes of a file name that are not UTF-8 become ``\\xNN`` escapes (Python holds them as
    lone surrogates, which cannot be encoded, printed or written to JSON)."""
    return os.fsencode(rel.as_posix()).decode("utf-8", errors="backslashreplace")


def name_digest(name: str) -> bytes:
    """The 16 leading bytes of the SHA-256 of ``name``: the key that orders documents for the validation split."""
    return hashlib.sha256(name.encode()).digest()[:16]


def held_out(digests: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which of n > 1 documents are validation: the ``round(n * val_fraction)`` (at least 1, at most n - 1) whose
    name digests are lowest.

    Args:
        digests: [n, 2] uint64: each row a :func:`name_digest` read as two big-endian numbers (so numeric order
            is byte order), in corpus order; :func:`digest_rows` makes it.
        val_fraction: in (0, 1).
    Returns:
        [n] bool, True for validation. Ties (a name repeated) keep corpus order.
    """
    n = len(digests)
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    mask = np.zeros(n, dtype=bool)
    mask[np.lexsort((digests[:, 1], digests[:, 0]))[:n_val]] = True  # lexsort is stable
    return mask


def digest_rows(digests: bytes) -> np.ndarray:
    """[n, 2] uint64 rows of the concatenated 16-byte :func:`name_digest` values ``digests``."""
    return np.frombuffer(digests, dtype=">u8").astype(np.uint64).reshape(-1, 2)


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """``(train_docs, val_docs)`` of ``docs`` (non-empty, from :func:`read_documents`), each in input order: whole
    documents held out by :func:`held_out`, or a single document split by :func:`split_only` (``val_docs`` is then
    empty for a one-character document). Adding or removing a file moves no other file between splits."""
    if len(docs) == 1:
        train, val_part = split_only(docs[0], val_fraction)
        return [train], [] if val_part is None else [val_part]
    val = held_out(digest_rows(b"".join(name_digest(d.name) for d in docs)), val_fraction)
    return [d for d, v in zip(docs, val) if not v], [d for d, v in zip(docs, val) if v]


def split_only(doc: Document | TokenDocument, val_fraction: float) -> tuple[Any, Any]:
    """A one-document corpus's (train, val) parts: the last ``val_fraction`` of its characters (starting after a
    newline if one lies within a tenth of the validation part of the exact cut) or ids, at least one, named
    ``<name>#val``; val is ``None`` when the document has under 2 characters (ids), too short to split."""
    seq: Any = doc.text if isinstance(doc, Document) else doc.ids
    n = len(seq)
    if n < 2:
        return doc, None
    cut = n - max(1, round(n * val_fraction))
    if isinstance(doc, Document):
        slack = max(1, (n - cut) // 10)
        newline = doc.text.rfind("\n", max(0, cut - slack), cut + slack)
        if 0 < newline + 1 < n:
            cut = newline + 1
    return type(doc)(doc.name, seq[:cut]), type(doc)(f"{doc.name}#val", seq[cut:])
