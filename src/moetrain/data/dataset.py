"""Prepared token streams (cached memmaps) and the windows, sampler and eval batches drawn from them.

B = batch size, S = seq_len, N = tokens in a split, W = windows in a split = (N - 1) // S.

Each split is one flat stream of token ids: the documents in order, each followed by EOS (id 0). A training
example is a window of S + 1 consecutive tokens: inputs are its first S, targets its last S.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from moetrain.data.config import DataConfig
from moetrain.data.corpus import discover_files, held_out, split_only
from moetrain.data.formats import find_pretokenized, open_tokens
from moetrain.data.prepare import (
    CACHE_VERSION, Corpus, Scan, scan, size_of, train_on_corpus, write_splits,
)
from moetrain.data.tokenizer import EOS_TOKEN, load_tokenizer, tokenizer_file
from moetrain.errors import ConfigError, DataError
from moetrain.runtime import cache_root


@dataclass(frozen=True)
class PreparedData:
    """A corpus tokenized into a training and a validation stream.

    Fields:
        tokenizer: the tokenizer (trained byte-level BPE or given); ``tokenizer.get_vocab_size() <= vocab_size``.
        train_tokens: [N_train] uint16 (vocab_size <= 65535) or uint32, read-only memmap of the training split.
        val_tokens: [N_val] same dtype, the validation split.
        eos_id: id of ``EOS_TOKEN`` (0), which follows every document in both streams.
        num_train_docs: documents in the training split.
        num_val_docs: documents in the validation split.
        skipped: files (and ``.jsonl`` lines) skipped while reading (binary, unreadable, empty, malformed).
        cache_path: the cache entry directory: ``tokenizer.json``, ``meta.json`` (counts) and the token files of
            data/prepare.py.
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
    """Discover, read, split, tokenize and cache the corpus described by ``cfg``, in bounded memory (the passes:
    data/prepare.py; pre-tokenized input is split and copied the same way without tokenizing).

    The tokenizer is, in order of precedence: ``tokenizer_path`` (resuming or evaluating a run), ``cfg.tokenizer``
    (a pretrained one), else a byte-level BPE tokenizer trained on at most ``cfg.tokenizer_max_bytes`` of the
    training split. The result is cached (:func:`_cache_key`; the cache entry: docs/data.md, "Preparation"): a
    cache hit reads no corpus file and trains nothing, and an interrupted or refused preparation leaves no entry.

    Args:
        cfg: the data config.
        vocab_size: the model's vocabulary size (>= 257).
        tokenizer_path: an existing ``tokenizer.json`` to use instead of training one.
        log: receives one-line progress messages.
    Returns:
        The :class:`PreparedData`.
    Raises:
        DataError: a missing path, no usable text, a missing text column, a truncated or corrupt file, a tokenizer
            that cannot be loaded, pre-tokenized input without a tokenizer or with ids outside its vocabulary, a
            wrong ``token_dtype``, or a split with fewer than ``cfg.seq_len + 1`` tokens.
        ConfigError: ``vocab_size < 257``, or a given tokenizer larger than ``vocab_size``.
    """
    source = cfg.path if cfg.path is not None else "the default corpus (Python standard library)"
    pretokenized = find_pretokenized(cfg.path)
    files = list(pretokenized.files) if pretokenized is not None else discover_files(cfg.path)
    given_path = tokenizer_path if tokenizer_path is not None else \
        (tokenizer_file(cfg.tokenizer) if cfg.tokenizer is not None else None)
    given = load_tokenizer(given_path) if given_path is not None else None
    given_json = given.to_str() if given is not None else None
    if given is not None and given.get_vocab_size() > vocab_size:
        raise ConfigError(f"model.vocab_size: tokenizer '{given_path}' has {given.get_vocab_size()} tokens, "
                          f"more than vocab_size {vocab_size}")
    if pretokenized is not None:
        _check_pretokenized_tokenizer(cfg, given, tokenizer_path, source)
    entry = cache_root(cfg.cache_dir) / f"tokens-{_cache_key(files, cfg, vocab_size, given_json)}"
    dtype = np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)

    meta = _load_entry(entry, dtype)
    if meta is not None:
        log(f"data: reused cached tokenizer and tokens from {entry}")
    else:
        corpus = Corpus(files, cfg, pretokenized, given)
        meta = _build_entry(entry, corpus, source, cfg, vocab_size, given, dtype, log)
        if given is None:
            # A resumed run passes the tokenizer it saved; alias the entry under that key too, so resuming
            # reuses these tokens instead of tokenizing the corpus again.
            trained_json = load_tokenizer(entry / "tokenizer.json").to_str()
            _atomic_symlink(entry.name, entry.parent / f"tokens-{_cache_key(files, cfg, vocab_size, trained_json)}")
    data = PreparedData(
        tokenizer=load_tokenizer(entry / "tokenizer.json"),
        train_tokens=open_tokens(entry / "train.bin", dtype),
        val_tokens=open_tokens(entry / "val.bin", dtype),
        eos_id=meta["eos_id"], num_train_docs=meta["num_train_docs"], num_val_docs=meta["num_val_docs"],
        skipped=meta["skipped"], cache_path=entry)
    log(f"data: {source}: train {data.num_train_docs} docs / {len(data.train_tokens):,} tokens, "
        f"val {data.num_val_docs} docs / {len(data.val_tokens):,} tokens, {data.skipped} skipped, "
        f"vocab {data.tokenizer.get_vocab_size()}")
    # seq_len is not in the cache key: a cached entry may be too short for this one
    _check_long_enough(len(data.train_tokens), len(data.val_tokens), cfg, source)
    return data


def _check_pretokenized_tokenizer(cfg: DataConfig, given: Tokenizer | None, tokenizer_path: Path | None,
                                  source: str) -> None:
    """Pre-tokenized ids mean nothing without the tokenizer that made them."""
    if given is None:
        raise DataError(f"data path '{source}' is pre-tokenized: set data.tokenizer to the tokenizer its ids were "
                        f"made with (a tokenizer.json or a tokenizer folder)")
    if tokenizer_path is not None and cfg.tokenizer is not None and \
            load_tokenizer(tokenizer_file(cfg.tokenizer)).to_str() != given.to_str():
        raise DataError(f"data.tokenizer '{cfg.tokenizer}' differs from the tokenizer '{tokenizer_path}' this run "
                        f"uses: the pre-tokenized ids of '{source}' were made with one of them only")


def _check_long_enough(train: int, val: int, cfg: DataConfig, source: str, bound: str = "") -> None:
    """Refuse splits of ``train`` / ``val`` tokens (``bound="at most "``: upper bounds) shorter than a sequence."""
    need = cfg.seq_len + 1
    if train < need:
        raise DataError(f"corpus '{source}' is shorter than one sequence of data.seq_len={cfg.seq_len} tokens "
                        f"({bound}{train} training tokens, need {need}); lower data.seq_len or add text")
    if val < need:
        raise DataError(f"validation split of '{source}' is shorter than one sequence of "
                        f"data.seq_len={cfg.seq_len} tokens ({bound}{val} tokens, need {need}); lower "
                        f"data.seq_len or raise data.val_fraction")


def _split_sizes(found: Scan, val: np.ndarray | None, val_fraction: float) -> list[tuple[int, int]]:
    """``[(documents, most tokens)]`` of the train and val splits from the scan; the tokens (EOS included) are exact
    for pre-tokenized documents, and a byte-level BPE tokenizer makes at most one token per UTF-8 byte."""
    if found.only is not None:
        return [(0, 0) if part is None else (1, size_of(part) + 1) for part in split_only(found.only, val_fraction)]
    assert val is not None
    return [(int(m.sum()), int(found.sizes[m].sum() + m.sum())) for m in (~val, val)]


def _cache_key(files: Sequence[Path], cfg: DataConfig, vocab_size: int, tokenizer_json: str | None) -> str:
    """Hash of everything the cached tokens depend on; file sizes, mtimes and ctimes stand in for contents (speed).
    The ctime catches what the mtime misses: an edit whose mtime was put back (``cp -p``, ``touch -r``, an archive)
    and a file made readable by ``chmod`` (it was skipped as unreadable); it costs a rebuild after a mere chmod."""
    h = hashlib.sha256()
    fields: dict[str, object] = {"version": CACHE_VERSION, "val_fraction": cfg.val_fraction, "vocab_size": vocab_size,
              "tokenizer_max_bytes": cfg.tokenizer_max_bytes}
    if cfg.text_field != "text":
        fields["text_field"] = cfg.text_field
    if cfg.token_dtype is not None:
        fields["token_dtype"] = cfg.token_dtype
    h.update(json.dumps(fields).encode())
    # a `datasets` folder stands for the files in it
    files = [g for f in files for g in (sorted(p for p in f.rglob("*") if p.is_file()) if f.is_dir() else [f])]
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
                       and (entry / f"{split}.idx").stat().st_size == meta[f"num_{split}_docs"] * 8
                       for split in ("train", "val"))
        return meta if sizes_ok and meta.get("version") == CACHE_VERSION and \
            (entry / "tokenizer.json").is_file() else None
    except (OSError, ValueError, KeyError):
        return None


def _build_entry(entry: Path, corpus: Corpus, source: str, cfg: DataConfig, vocab_size: int,
                 given: Tokenizer | None, dtype: np.dtype, log: Callable[[str], None]) -> dict:
    """Scan, split, (train a tokenizer,) tokenize and write ``entry`` (data/prepare.py); returns its meta.

    A corpus too short for one sequence per split is refused before its split when the scan proves it (text for a
    trained tokenizer, pre-tokenized ids), else after tokenizing; either way nothing is left in the cache.
    """
    t0 = time.perf_counter()
    found = scan(corpus, source)
    val = held_out(found.digests, cfg.val_fraction) if found.only is None else None
    (n_train, most_train), (n_val, most_val) = _split_sizes(found, val, cfg.val_fraction)
    if given is None or corpus.pretokenized is not None:
        _check_long_enough(most_train, most_val, cfg, source, "at most ")
    log(f"data: read {found.stats.files} files -> {found.stats.documents} documents, {found.stats.describe()}, in "
        f"{time.perf_counter() - t0:.1f} s; split {n_train} train / {n_val} val")
    tok = given if given is not None else train_on_corpus(corpus, found, val, cfg, vocab_size, log)
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id is not None  # train_tokenizer puts EOS_TOKEN at id 0; load_tokenizer rejects a tokenizer without it

    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_stages(entry)
    # host-pid in the name: a later build can tell an abandoned stage (_remove_abandoned_stages)
    builder = f"{socket.gethostname()}-{os.getpid()}"
    stage = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.{builder}.", suffix=".tmp"))
    try:
        t0 = time.perf_counter()
        written = write_splits(stage, corpus, found, val, tok, eos_id, dtype, cfg.val_fraction)
        seconds = time.perf_counter() - t0
        rate = "" if corpus.pretokenized is not None else \
            f" ({int(found.sizes.sum()) / 1e6 / max(seconds, 1e-9):.1f} MB/s)"
        log(f"data: tokenized {written['train'][1] + written['val'][1]:,} tokens in {seconds:.1f} s{rate} -> {entry}")
        _check_long_enough(written["train"][1], written["val"][1], cfg, source)
        meta = {"version": CACHE_VERSION, "eos_id": eos_id, "num_train_docs": written["train"][0],
                "num_val_docs": written["val"][0], "skipped": found.stats.skipped,
                "num_train_tokens": written["train"][1], "num_val_tokens": written["val"][1]}
        (stage / "tokenizer.json").write_text(tok.to_str())
        (stage / "meta.json").write_text(json.dumps(meta, indent=1))
        _publish(stage, entry)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return meta


def _remove_abandoned_stages(entry: Path) -> None:
    """Delete the staging directories of ``entry`` whose builder on this host is gone (a killed preparation leaves
    one behind, as large as the token files it had written); another host's, or a live process's, are left alone."""
    host = socket.gethostname()
    for stage in entry.parent.glob(f".{glob.escape(entry.name)}.{glob.escape(host)}-*.tmp"):
        pid = stage.name[len(f".{entry.name}.{host}-"):].split(".", 1)[0]
        if pid.isdigit() and not process_exists(int(pid)):
            shutil.rmtree(stage, ignore_errors=True)


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (``os.kill(pid, 0)``; another user's counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _publish(stage: Path, entry: Path) -> None:
    """Rename the complete directory ``stage`` to ``entry`` (its files fsynced first, so a crash leaves the whole
    entry or none), replacing a stale entry or a concurrent build's identical one."""
    for f in stage.iterdir():
        with open(f, "rb") as h:
            os.fsync(h.fileno())
    os.chmod(stage, 0o755)  # mkdtemp makes it 0700; a shared cache should be readable like any directory
    replace_directory(stage, entry)


def replace_directory(new: Path, target: Path) -> None:
    """Rename the complete directory ``new`` (a sibling of ``target``) to ``target``. Whatever is at ``target`` (a
    non-empty directory, an alias symlink; an empty directory is simply replaced) is first moved aside into a
    temporary sibling, deleted once ``new`` is in place: ``target`` is never a mix of the two."""
    try:
        os.rename(new, target)
    except OSError:
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
        os.rename(target, old / "entry")
        os.rename(new, target)
        shutil.rmtree(old, ignore_errors=True)


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
    the same batches. ``sampler[position]`` is the batch drawn at ``position`` (a map-style dataset keyed by sample
    position, for data/loader.py).

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
        self._perm_key, self._perm = (seed, -1), np.zeros(0, dtype=np.int64)  # cache of one derived permutation

    def __getitem__(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(inputs, targets)``, [B, S] int64 each, drawn at sample ``position``."""
        n = len(self.windows)
        positions = np.arange(position, position + self.batch_size)
        indices = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(positions // n):
            mask = positions // n == epoch
            indices[mask] = self._permutation(int(epoch))[positions[mask] % n]
        return self.windows.get(indices)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, targets)``, [B, S] int64 each; advances ``position`` by B."""
        self.position += self.batch_size
        return self[self.position - self.batch_size]

    def key_after(self, position: int) -> int:
        """The sample position of the batch after the one drawn at ``position``."""
        return position + self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if (self.seed, epoch) != self._perm_key:
            self._perm_key = (self.seed, epoch)
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
        return self._perm

    def state_dict(self) -> dict[str, int]:
        """``{"position": int, "seed": int}``: everything needed to resume."""
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict` (the seed is restored too)."""
        self.position = int(state["position"])
        self.seed = int(state["seed"])


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
