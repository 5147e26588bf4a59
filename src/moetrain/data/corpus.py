"""Corpus files -> documents -> train / validation split.

Everything here is deterministic and independent of the machine: files are sorted by relative path, document
names are relative to the corpus root, and the validation split is chosen by a hash of those names.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from moetrain.errors import DataError

# A file with a NUL byte in its first 8 KiB is binary (the heuristic git and grep use).
_BINARY_PROBE_BYTES = 8192
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


@dataclass(frozen=True)
class Document:
    """One unit of text: a whole file, or one line of a ``.jsonl`` file.

    Fields:
        name: path relative to the corpus root in posix form (``pkg/mod.py``); ``file.jsonl:12`` for line 12 of a
            ``.jsonl`` file. Unique within a corpus and the same on every machine.
        text: the document's text (never empty).
    """

    name: str
    text: str


@dataclass(frozen=True)
class ReadStats:
    """What :func:`read_documents` did with its files.

    Fields:
        files: files given.
        documents: documents kept.
        binary: files skipped as binary (a NUL byte in the first 8 KiB) or not valid UTF-8.
        unreadable: files skipped because they could not be read (permissions, vanished, a directory).
        empty: files (or ``.jsonl`` lines) skipped because their text is empty.
        bad_lines: ``.jsonl`` lines skipped: invalid JSON, or no string ``text`` field.
    """

    files: int = 0
    documents: int = 0
    binary: int = 0
    unreadable: int = 0
    empty: int = 0
    bad_lines: int = 0

    @property
    def skipped(self) -> int:
        """Files and ``.jsonl`` lines skipped, for any reason."""
        return self.binary + self.unreadable + self.empty + self.bad_lines

    def describe(self) -> str:
        """``'3 skipped (2 binary, 1 unreadable)'``; ``'0 skipped'`` when nothing was."""
        parts = [f"{n} {what}" for n, what in ((self.binary, "binary"), (self.unreadable, "unreadable"),
                                                (self.empty, "empty"), (self.bad_lines, "bad .jsonl lines")) if n]
        return f"{self.skipped} skipped" + (f" ({', '.join(parts)})" if parts else "")


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
        path: ``None`` for :func:`default_corpus_files`; a file; a directory (every regular file below it,
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
    if target.is_file():
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


def read_documents(files: Sequence[Path], source: str | None = None) -> tuple[list[Document], ReadStats]:
    """Read ``files`` into documents, in order, skipping what is not usable text.

    A ``.jsonl`` file gives one document per line (its ``text`` field); any other file is one UTF-8 document.

    Args:
        files: from :func:`discover_files`.
        source: how error messages name the corpus (default: the common directory of ``files``).
    Returns:
        ``(documents, stats)``; document names are relative to the common directory of ``files``.
    Raises:
        DataError: nothing usable remains (the message counts the skipped files by reason); or a ``.jsonl`` file
            has lines but none with a string ``text`` field (likely a different schema).
    """
    files = [Path(os.path.abspath(f)) for f in files]
    root = Path(os.path.commonpath([f.parent for f in files])) if files else Path(".")
    source = source if source is not None else str(root)
    docs: list[Document] = []
    counts = {"binary": 0, "unreadable": 0, "empty": 0, "bad_lines": 0}
    for f in files:
        name = _name(f.relative_to(root))
        try:
            raw = f.read_bytes()
        except OSError:
            counts["unreadable"] += 1
            continue
        if f.suffix == ".jsonl":
            docs += _read_jsonl(f, name, raw, counts)
            continue
        text = _decode(raw)
        if text is None:
            counts["binary"] += 1
        elif not text:
            counts["empty"] += 1
        else:
            docs.append(Document(name, text))
    stats = ReadStats(files=len(files), documents=len(docs), **counts)
    if not docs:
        raise DataError(f"no usable text in '{source}': {len(files)} files, {stats.describe()}")
    return docs, stats


def _name(rel: Path) -> str:
    """``rel`` in posix form; bytes of a file name that are not UTF-8 become ``\\xNN`` escapes (Python holds them as
    lone surrogates, which cannot be encoded, printed or written to JSON)."""
    return os.fsencode(rel.as_posix()).decode("utf-8", errors="backslashreplace")


def _decode(raw: bytes) -> str | None:
    """UTF-8 text of ``raw``; ``None`` for binary or non-UTF-8 bytes."""
    if b"\0" in raw[:_BINARY_PROBE_BYTES]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_jsonl(f: Path, name: str, raw: bytes, counts: dict[str, int]) -> list[Document]:
    """One document per line of ``f`` with a non-empty string ``text`` field; counts the rest in ``counts``."""
    text = _decode(raw)
    if text is None:
        counts["binary"] += 1
        return []
    docs, lines, bad = [], 0, 0
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines(): JSON keeps U+2028 raw
        if not line.strip():
            continue
        lines += 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        doc_text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(doc_text, str):
            bad += 1
        elif not doc_text:
            counts["empty"] += 1
        else:
            docs.append(Document(f"{name}:{lineno}", doc_text))
    counts["bad_lines"] += bad
    if not docs and bad:
        raise DataError(f"no usable text in '{f}': {bad} of {lines} lines are not JSON objects with a string "
                        f"'text' field")
    if not lines:
        counts["empty"] += 1
    return docs


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Hold out whole documents for validation, chosen by a hash of their names.

    The ``round(len(docs) * val_fraction)`` documents (at least 1, at most ``len(docs) - 1``) whose name hashes
    lowest are validation; both splits keep the input order. Adding or removing a file moves no other file between
    splits. A single document is split by text instead: its last ``val_fraction`` of characters (starting after
    a newline when there is one nearby) are validation, named ``<name>#val``.

    Args:
        docs: from :func:`read_documents` (non-empty).
        val_fraction: in (0, 1).
    Returns:
        ``(train_docs, val_docs)``, disjoint; ``val_docs`` is empty only for a single one-character document.
    """
    if len(docs) == 1:
        return _split_text(docs[0], val_fraction)
    n_val = min(max(1, round(len(docs) * val_fraction)), len(docs) - 1)
    by_hash = sorted(range(len(docs)), key=lambda i: hashlib.sha256(docs[i].name.encode()).digest())
    val_ids = set(by_hash[:n_val])
    train = [d for i, d in enumerate(docs) if i not in val_ids]
    val = [d for i, d in enumerate(docs) if i in val_ids]
    return train, val


def _split_text(doc: Document, val_fraction: float) -> tuple[list[Document], list[Document]]:
    text = doc.text
    if len(text) < 2:
        return [doc], []
    cut = len(text) - max(1, round(len(text) * val_fraction))
    # Start validation on a line boundary if one lies within a 1/10 of the validation part of the exact cut.
    slack = max(1, (len(text) - cut) // 10)
    newline = text.rfind("\n", max(0, cut - slack), cut + slack)
    if 0 < newline + 1 < len(text):
        cut = newline + 1
    return [Document(doc.name, text[:cut])], [Document(f"{doc.name}#val", text[cut:])]
