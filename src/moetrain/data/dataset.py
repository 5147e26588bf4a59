"""Prepared token streams (cached memmaps) and the windows, sampler and eval batches drawn from them.

B = batch size, S = seq_len, N = tokens in a split, W = windows in a split = (N - 1) // S.

Each split is one flat stream of token ids: the documents in order, each followed by EOS (id 0). A training
example is a window of S + 1 consecutive tokens: inputs are its first S, targets its last S.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from moetrain.data.config import DataConfig
from moetrain.data.corpus import (
    Document,
    discover_files,
    read_documents,
    split_documents,
)
from moetrain.data.tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer
from moetrain.errors import ConfigError, DataError

# Bump when the cache layout or the tokenization changes, so old entries are never trusted.
_CACHE_VERSION = 1
# Text per encode_batch call (~1M tokens): bounds the memory of the Encoding objects, which cost ~100 bytes per
# token, whatever the corpus size; larger chunks are no faster.
_ENCODE_CHUNK_CHARS = 4_000_000


@dataclass(frozen=True)
class PreparedData:
    """A corpus tokenized into a training and a validation stream.

    Fields:
        tokenizer: the byte-level BPE tokenizer; ``tokenizer.get_vocab_size() <= vocab_size``.
        train_tokens: [N_train] uint16 (vocab_size <= 65535) or uint32, read-only memmap of the training split.
        val_tokens: [N_val] same dtype, the validation split.
        eos_id: id of ``EOS_TOKEN`` (0), which follows every document in both streams.
        num_train_docs: documents in the training split.
        num_val_docs: documents in the validation split.
        skipped: files (and ``.jsonl`` lines) skipped while reading (binary, unreadable, empty, malformed).
        cache_path: the cache entry directory (``tokenizer.json``, ``train.bin``, ``val.bin``, ``meta.json``).
    """

    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    eos_id: int
    num_train_docs: int
    num_val_docs: int
    skipped: int
    cache_path: Path


def prepare_data(cfg: DataConfig, vocab_size: int, tokenizer_path: Path | None = None,
                 log: Callable[[str], None] = print) -> PreparedData:
    """Discover, read, split, tokenize and cache the corpus described by ``cfg``.

    The tokenizer is trained on at most ``cfg.tokenizer_max_bytes`` of the training split (documents in a
    fixed pseudo-random order), unless ``tokenizer_path`` names one to reuse (resuming or evaluating a run).
    Results are cached under ``cfg.cache_dir`` / ``$MOETRAIN_CACHE`` / ``~/.cache/moetrain``, keyed by the file
    list with sizes, mtimes and ctimes (not contents), ``val_fraction``, ``vocab_size``, ``tokenizer_max_bytes``
    and the given tokenizer; a cache hit reads no corpus file and trains nothing. Every cache file is written to a
    temporary name and renamed, and ``meta.json`` is written last, so an interrupted run leaves no entry that is
    later trusted.

    Args:
        cfg: the data config.
        vocab_size: the model's vocabulary size (>= 257).
        tokenizer_path: an existing ``tokenizer.json`` to use instead of training one.
        log: receives one-line progress messages.
    Returns:
        The :class:`PreparedData`.
    Raises:
        DataError: a missing path, no usable text, a tokenizer that cannot be loaded, or a split with fewer than
            ``cfg.seq_len + 1`` tokens.
        ConfigError: ``vocab_size < 257``, or a given tokenizer larger than ``vocab_size``.
    """
    source = cfg.path if cfg.path is not None else "the default corpus (Python standard library)"
    files = discover_files(cfg.path)
    given = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    given_json = given.to_str() if given is not None else None
    if given is not None and given.get_vocab_size() > vocab_size:
        raise ConfigError(f"model.vocab_size: tokenizer '{tokenizer_path}' has {given.get_vocab_size()} tokens, "
                          f"more than vocab_size {vocab_size}")
    entry = _cache_root(cfg) / f"tokens-{_cache_key(files, cfg, vocab_size, given_json)}"
    dtype = np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)

    meta = _load_entry(entry, dtype)
    if meta is not None:
        log(f"data: reused cached tokenizer and tokens from {entry}")
    else:
        meta = _build_entry(entry, files, source, cfg, vocab_size, given, dtype, log)
        if given is None:
            # A resumed run passes the tokenizer it saved; alias the entry under that key too, so resuming
            # reuses these tokens instead of tokenizing the corpus again.
            trained_json = load_tokenizer(entry / "tokenizer.json").to_str()
            _atomic_symlink(entry.name, entry.parent / f"tokens-{_cache_key(files, cfg, vocab_size, trained_json)}")
    data = PreparedData(
        tokenizer=load_tokenizer(entry / "tokenizer.json"),
        train_tokens=_open_tokens(entry / "train.bin", dtype),
        val_tokens=_open_tokens(entry / "val.bin", dtype),
        eos_id=meta["eos_id"], num_train_docs=meta["num_train_docs"], num_val_docs=meta["num_val_docs"],
        skipped=meta["skipped"], cache_path=entry)
    log(f"data: {source}: train {data.num_train_docs} docs / {len(data.train_tokens):,} tokens, "
        f"val {data.num_val_docs} docs / {len(data.val_tokens):,} tokens, {data.skipped} skipped, "
        f"vocab {data.tokenizer.get_vocab_size()}")
    _check_long_enough(data, cfg, source)
    return data


def _check_long_enough(data: PreparedData, cfg: DataConfig, source: str) -> None:
    need = cfg.seq_len + 1
    if len(data.train_tokens) < need:
        raise DataError(f"corpus '{source}' is shorter than one sequence of data.seq_len={cfg.seq_len} tokens "
                        f"({len(data.train_tokens)} training tokens, need {need}); lower data.seq_len or add text")
    if len(data.val_tokens) < need:
        raise DataError(f"validation split of '{source}' is shorter than one sequence of "
                        f"data.seq_len={cfg.seq_len} tokens ({len(data.val_tokens)} tokens, need {need}); lower "
                        f"data.seq_len or raise data.val_fraction")


def _cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("MOETRAIN_CACHE") or Path.home() / ".cache" / "moetrain"
    return Path(root).expanduser()


def _cache_key(files: Sequence[Path], cfg: DataConfig, vocab_size: int, tokenizer_json: str | None) -> str:
    """Hash of everything the cached tokens depend on; file sizes, mtimes and ctimes stand in for contents (speed).
    The ctime catches what the mtime misses: an edit whose mtime was put back (``cp -p``, ``touch -r``, an archive)
    and a file made readable by ``chmod`` (it was skipped as unreadable); it costs a rebuild after a mere chmod."""
    h = hashlib.sha256()
    h.update(json.dumps({"version": _CACHE_VERSION, "val_fraction": cfg.val_fraction, "vocab_size": vocab_size,
                         "tokenizer_max_bytes": cfg.tokenizer_max_bytes}).encode())
    for f in files:
        try:
            st = f.stat()
            # Both paths: a document is named by its own path, its text read from the symlink's target.
            # fsencode: a file name that is not UTF-8 keeps its bytes.
            h.update(os.fsencode(f"{os.path.abspath(f)}\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0"
                                 f"{st.st_ctime_ns}\n"))
        except OSError:  # read_documents counts it as unreadable; the key just has to be stable
            h.update(os.fsencode(f"{f}\0missing\n"))
    if tokenizer_json is not None:
        h.update(tokenizer_json.encode())
    return h.hexdigest()[:24]


def _load_entry(entry: Path, dtype: np.dtype) -> dict | None:
    """The entry's metadata if it is complete and consistent, else ``None`` (rebuild)."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        sizes_ok = all((entry / f"{split}.bin").stat().st_size == meta[f"num_{split}_tokens"] * dtype.itemsize
                       for split in ("train", "val"))
        return meta if sizes_ok and meta.get("version") == _CACHE_VERSION and \
            (entry / "tokenizer.json").is_file() else None
    except (OSError, ValueError, KeyError):
        return None


def _build_entry(entry: Path, files: Sequence[Path], source: str, cfg: DataConfig, vocab_size: int,
                 given: Tokenizer | None, dtype: np.dtype, log: Callable[[str], None]) -> dict:
    t0 = time.perf_counter()
    docs, stats = read_documents(files, source=source)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    log(f"data: read {stats.files} files -> {stats.documents} documents, {stats.describe()}, in "
        f"{time.perf_counter() - t0:.1f} s; split {len(train_docs)} train / {len(val_docs)} val")
    if given is None:
        t0 = time.perf_counter()
        sample = _tokenizer_sample(train_docs, cfg.tokenizer_max_bytes)
        tok = train_tokenizer(sample, vocab_size)
        log(f"data: trained a {tok.get_vocab_size()}-token byte-level BPE tokenizer on "
            f"{sum(len(t.encode()) for t in sample) / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
    else:
        tok = given
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id is not None  # train_tokenizer puts EOS_TOKEN at id 0; load_tokenizer rejects a tokenizer without it

    entry.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counts = {split: _write_tokens(entry / f"{split}.bin", tok, split_docs, eos_id, dtype)
              for split, split_docs in (("train", train_docs), ("val", val_docs))}
    log(f"data: tokenized {counts['train'] + counts['val']:,} tokens in {time.perf_counter() - t0:.1f} s "
        f"-> {entry}")
    _atomic_write(entry / "tokenizer.json", tok.to_str().encode())
    meta = {"version": _CACHE_VERSION, "eos_id": eos_id, "num_train_docs": len(train_docs),
            "num_val_docs": len(val_docs), "skipped": stats.skipped, "num_train_tokens": counts["train"],
            "num_val_tokens": counts["val"]}
    _atomic_write(entry / "meta.json", json.dumps(meta, indent=1).encode())  # last: marks the entry complete
    return meta


def _tokenizer_sample(docs: Sequence[Document], max_bytes: int) -> list[str]:
    """Up to ``max_bytes`` of UTF-8 text from ``docs``, visited in a fixed pseudo-random order so that a budget
    smaller than the corpus still sees all of it (not only the alphabetically first files)."""
    sample, used = [], 0
    for i in np.random.default_rng(0).permutation(len(docs)):
        if used >= max_bytes:
            break
        raw = docs[i].text.encode()
        if len(raw) > max_bytes - used:  # cut the last document to fit; drop a split multibyte character
            raw = raw[:max_bytes - used]
            sample.append(raw.decode("utf-8", errors="ignore"))
        else:
            sample.append(docs[i].text)
        used += len(raw)
    return sample


def _write_tokens(path: Path, tok: Tokenizer, docs: Sequence[Document], eos_id: int, dtype: np.dtype) -> int:
    """Write the ids of ``docs`` (each followed by ``eos_id``) to ``path`` atomically; returns the count."""
    n = 0
    with _AtomicFile(path) as f:
        start = 0
        while start < len(docs):
            end, chars = start, 0
            while end < len(docs) and (end == start or chars + len(docs[end].text) <= _ENCODE_CHUNK_CHARS):
                chars += len(docs[end].text)
                end += 1
            # encode_batch_fast (tokenizers >= 0.20) gives the same ids as encode_batch without computing
            # offsets: ~1.5x faster on 2 cores.
            encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
            for enc in encode_batch([d.text for d in docs[start:end]], add_special_tokens=False):
                ids = np.array(enc.ids + [eos_id], dtype=dtype)
                f.write(ids.tobytes())
                n += len(ids)
            start = end
    return n


def _open_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    """[N] read-only memmap of ``path``; np.memmap refuses empty files, so an empty split is a plain array."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class _AtomicFile:
    """A binary file written under a temporary name in the same directory and renamed into place on success
    (fsync first, so a crash leaves either the old file or the complete new one, never a partial one)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        fd, self.tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        os.chmod(self.tmp, 0o644)  # mkstemp makes it 0600; a shared cache should be readable like any file
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            with self.file:
                if exc_type is None:
                    self.file.flush()
                    os.fsync(self.file.fileno())
            if exc_type is None:
                os.replace(self.tmp, self.path)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


def _atomic_write(path: Path, data: bytes) -> None:
    with _AtomicFile(path) as f:
        f.write(data)


def _atomic_symlink(target: str, link: Path) -> None:
    """Point ``link`` at ``target`` (a sibling name); best effort: a filesystem without symlinks only loses the
    alias."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)


class TokenWindows:
    """The non-overlapping training windows of a token stream: window i is ``tokens[i*S : i*S + S + 1]``.

    Consecutive windows share one token (the last target of window i is the first input of window i + 1), so
    every token is predicted once; ``W = (N - 1) // S``.

    Args:
        tokens: [N] integer token ids (e.g. a memmap from :class:`PreparedData`); not copied.
        seq_len: S, tokens per input sequence.
    Raises:
        ValueError: ``seq_len < 1`` or fewer than ``seq_len + 1`` tokens (no window).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1 or len(tokens) < seq_len + 1:
            raise ValueError(f"need seq_len >= 1 and at least seq_len + 1 = {seq_len + 1} tokens, "
                             f"got seq_len={seq_len} and {len(tokens)} tokens")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def get(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of the windows at ``indices``.

        Args:
            indices: [B] window indices in ``[0, len(self))``.
        Returns:
            ``(inputs, targets)``: [B, S] int64 CPU tensors each; ``targets[:, t] == inputs[:, t + 1]`` for
            ``t < S - 1`` (targets are the next tokens).
        Raises:
            IndexError: an index out of range.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)}): {idx.min()}..{idx.max()}")
        # Fancy indexing reads only these windows' pages of a memmap; astype copies to int64 (embedding ids).
        offsets = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1)  # [B, S+1]
        windows = torch.from_numpy(np.asarray(self.tokens[offsets]).astype(np.int64))  # [B, S+1]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class BatchSampler:
    """Deterministic, resumable sampling of windows without replacement.

    Epoch e visits the windows in the order ``numpy.random.default_rng([seed, e]).permutation(W)``; samples are
    drawn from the concatenation of epochs 0, 1, 2, ..., so a batch may span an epoch boundary. ``position`` (samples
    drawn so far) and ``seed`` are the whole state: two samplers over the same windows at the same position draw
    the same batches.

    Args:
        windows: the :class:`TokenWindows` to draw from.
        batch_size: B, windows per batch.
        seed: sampling seed.
    """

    def __init__(self, windows: TokenWindows, batch_size: int, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.windows = windows
        self.batch_size = batch_size
        self.seed = seed
        self.position = 0
        self._perm_epoch, self._perm = -1, np.zeros(0, dtype=np.int64)  # cache of one derived permutation

    @property
    def epoch(self) -> float:
        """Epochs drawn so far (fractional)."""
        return self.position / len(self.windows)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, targets)``, [B, S] int64 each; advances ``position`` by B."""
        n = len(self.windows)
        positions = np.arange(self.position, self.position + self.batch_size)
        indices = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(positions // n):
            mask = positions // n == epoch
            indices[mask] = self._permutation(int(epoch))[positions[mask] % n]
        self.position += self.batch_size
        return self.windows.get(indices)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm_epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(
                len(self.windows))
        return self._perm

    def state_dict(self) -> dict[str, int]:
        """``{"position": int, "seed": int}``: everything needed to resume."""
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict` (the seed is restored too)."""
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        self._perm_epoch = -1


def eval_batches(windows: TokenWindows, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: the first windows in order, as full batches.

    Args:
        windows: the validation :class:`TokenWindows`.
        batch_size: B.
        n_batches: batches wanted.
    Returns:
        ``min(n_batches, W // B)`` batches of ``(inputs, targets)``, [B, S] int64 each; when ``W < B``, one
        batch of all W windows ([W, S]). Never empty.
    Raises:
        ValueError: ``batch_size < 1`` or ``n_batches < 1``.
    """
    if batch_size < 1 or n_batches < 1:
        raise ValueError(f"batch_size and n_batches must be >= 1, got {batch_size} and {n_batches}")
    n_full = min(n_batches, len(windows) // batch_size)
    if n_full == 0:
        return [windows.get(np.arange(len(windows)))]
    return [windows.get(np.arange(i * batch_size, (i + 1) * batch_size)) for i in range(n_full)]
