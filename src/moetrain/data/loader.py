"""Training batches in a fixed, resumable order, built in the background by ``torch.utils.data.DataLoader`` workers:
every micro-batch is a pure function of its key, the checkpoint state is the key of the next batch not consumed,
and workers never outlive the training process (docs/data.md, "Background loading").
"""

from __future__ import annotations

import functools
import os
import select
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from moetrain.data.batch import Batch, PackedBatch
from moetrain.data.dataset import BatchSampler, PreparedData, TokenWindows, eval_batches, process_exists
from moetrain.data.packing import DocumentBatches, DocumentChunks
from moetrain.data.val_coverage import small_split_warning, val_coverage_note
from moetrain.errors import ConfigError


class BatchLoader:
    """The training batch source: :meth:`next_batch`, and :meth:`state_dict` / :meth:`load_state_dict` for
    checkpoints (the trainer's ``sampler``).

    Args:
        dataset: :class:`~moetrain.data.dataset.BatchSampler` or :class:`~moetrain.data.packing.DocumentBatches`.
        seed: the order's seed (saved with the position).
        workers: DataLoader worker processes (0: build batches in this process).
        prefetch: batches each worker keeps ready.
        pin_memory: page-locked batches (for an asynchronous copy to CUDA).
    """

    def __init__(self, dataset: BatchSampler | DocumentBatches, seed: int, workers: int = 0, prefetch: int = 2,
                 pin_memory: bool = False):
        self.dataset, self.seed = dataset, seed
        self.workers, self.prefetch, self.pin_memory = workers, prefetch, pin_memory
        self._key: Any = 0 if isinstance(dataset, BatchSampler) else (0, 0)  # of the next batch not yet returned
        self._it: Iterator[tuple[Any, Batch]] | None = None
        self.padding_tokens = 0  # positions that were padding, over the batches returned since the last take
        self.positions = 0  # all positions of those batches

    # -- keys: sample positions (windows) or (epoch, index) (documents) ----------------------------------------------
    def _keys_from(self, key: Any) -> Iterator[Any]:
        while True:
            yield key
            key = self.dataset.key_after(key)

    # -- batches -------------------------------------------------------------------------------------------------
    def _start(self) -> Iterator[tuple[Any, Batch]]:
        keys = self._keys_from(self._key)
        if self.workers == 0:
            return ((key, self.dataset[key]) for key in keys)
        loader = DataLoader(_Keyed(self.dataset), batch_size=None, sampler=keys, num_workers=self.workers,
                            prefetch_factor=self.prefetch, pin_memory=self.pin_memory, persistent_workers=False,
                            worker_init_fn=functools.partial(_exit_with, os.getpid()))
        return iter(loader)

    def next_batch(self) -> Batch:
        """The next micro-batch: ``(inputs, targets)`` [B, S] int64 (windows) or a
        :class:`~moetrain.data.batch.PackedBatch` (documents). Starts the workers on the first call."""
        if self._it is None:
            self._it = self._start()
        key, batch = next(self._it)
        if isinstance(key, torch.Tensor):  # the DataLoader collates an int key into a tensor
            key = int(key)
        elif isinstance(key, (list, tuple)):
            key = tuple(int(k) for k in key)
        self._key = self.dataset.key_after(key)
        if isinstance(batch, PackedBatch):
            n = batch.padding_mask.numel()
            self.positions += n
            self.padding_tokens += n - batch.real_tokens
        return batch

    def close(self) -> None:
        """Stop the worker processes now (else they live until the iterator is garbage-collected, and a process
        forked meanwhile inherits it). The position is kept: :meth:`next_batch` starts them again."""
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._it = None

    def take_padding_fraction(self) -> float | None:
        """Share of padding positions over the batches returned since the last call (the ``padding_fraction``
        metric); ``None`` when none was a PackedBatch (windows never pad). Resets the count."""
        fraction = self.padding_tokens / self.positions if self.positions else None
        self.padding_tokens = self.positions = 0
        return fraction

    # -- checkpoint state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """``{"position", "seed"}`` (windows: the same as :meth:`BatchSampler.state_dict`) or ``{"epoch",
        "index", "seed"}`` (documents): the next batch not yet returned."""
        key = self._key
        state = {"position": key} if isinstance(key, int) else {"epoch": key[0], "index": key[1]}
        return {**state, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state`` (before the first :meth:`next_batch`; a running loader is restarted).

        Raises:
            KeyError: ``state`` is of the other packing (a checkpoint of a windows run resumed with documents).
        """
        windows = isinstance(self._key, int)
        self._key = int(state["position"]) if windows else (int(state["epoch"]), int(state["index"]))
        self.seed = int(state["seed"])
        self.dataset.seed = self.seed  # both datasets key their cached orders by the seed
        self._it = None


def _exit_with(trainer: int, worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a daemon thread that ends this worker (``os._exit``) as soon as the process
    ``trainer`` (the one that made the DataLoader) has ended. Waits on a pidfd (Linux >= 5.3: readable once the
    process has exited, zombie or not); elsewhere polls ``os.kill(trainer, 0)`` every second."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(trainer)
        except (AttributeError, OSError):  # no pidfd here, or the trainer is already gone
            while process_exists(trainer):
                time.sleep(1.0)
        else:
            select.select([fd], [], [])
        os._exit(0)

    threading.Thread(target=watch, name=f"moetrain-worker-{worker_id}-watch", daemon=True).start()


class _Keyed(torch.utils.data.Dataset):
    """Yields ``(key, batch)``, so the consumer knows which batch it got (the resume position)."""

    def __init__(self, dataset: BatchSampler | DocumentBatches):
        self.dataset = dataset

    def __getitem__(self, key):
        return key, self.dataset[key]


@dataclass
class DataPipeline:
    """What the trainer reads: the training batch source and the fixed validation batches.

    Fields:
        train: the :class:`BatchLoader`.
        val: validation micro-batches (the same packing as training, fixed shape, in stream order).
        describe: one line for the log (``"1234 training windows of 256 tokens"``).
        val_note: lines for the log when one held-out document dominates the evaluated tokens
            (:func:`~moetrain.data.val_coverage.val_coverage_note`) or the split is smaller than the evaluation
            asks for (:func:`~moetrain.data.val_coverage.small_split_warning`), else ``None``.
    """

    train: BatchLoader
    val: list[Batch]
    describe: str
    val_note: str | None = None


def check_packing(packing: str, ranks: int) -> None:
    """Refuse ``data.packing=documents`` on several ranks (the trainer and ``--dry-run`` both call it).

    Raises:
        ConfigError: ``documents`` with ``ranks > 1`` (the ranks' row split of a micro-batch assumes equal windows).
    """
    if packing == "documents" and ranks > 1:
        raise ConfigError("data.packing: 'documents' is not supported with several ranks yet; use 'windows'")


def validation_batches(data: PreparedData, seq_len: int, packing: str, batch_size: int, count: int,
                       seed: int) -> tuple[list[Batch], str | None]:
    """The fixed validation micro-batches training evaluates (``moetrain eval`` rebuilds the same), and the note on
    how much of the split they cover (windows only; ``None`` when nothing needs saying).

    Args:
        data / seq_len / packing / batch_size / seed: as :func:`build_pipeline`.
        count: ``train.eval_batches``: the first ``count`` batches of the split, in stream order.
    Returns:
        (batches, note): ``windows``: (inputs [B, S], targets [B, S]) int64 pairs; ``documents``: packed
        batches (:class:`~moetrain.data.batch.PackedBatch`), unshuffled. The note: the coverage note and the
        small-split warning (:mod:`~moetrain.data.val_coverage`), one per line, or ``None``.
    """
    if packing == "windows":
        windows = eval_batches(TokenWindows(data.val_tokens, seq_len), batch_size, count)
        rows = sum(inputs.shape[0] for inputs, _ in windows)
        notes = [val_coverage_note(data.val_tokens, data.eos_id, rows, seq_len, data.num_val_docs, batch_size)]
        batches: list[Batch] = list(windows)
    else:
        val_docs = DocumentBatches(DocumentChunks(data.val_tokens, data.eos_id, seq_len), batch_size, 0, seed,
                                   shuffle=False)
        packed = [val_docs[(0, i)] for i in range(min(count, val_docs.num_batches(0)))]
        rows, notes, batches = sum(b.inputs.shape[0] for b in packed), [], list(packed)
    notes.append(small_split_warning(len(data.val_tokens), data.num_val_docs, rows, batch_size, count, seq_len))
    return batches, "\n".join(n for n in notes if n) or None


def build_pipeline(data: PreparedData, seq_len: int, packing: str, batch_size: int, tokens_per_batch: int,
                   eval_batch_count: int, seed: int, workers: int = 0, prefetch: int = 2,
                   pin_memory: bool = False) -> DataPipeline:
    """The :class:`DataPipeline` of a prepared corpus.

    Args:
        data: from :func:`~moetrain.data.dataset.prepare_data`.
        seq_len: ``data.seq_len``.
        packing: ``data.packing`` (``windows`` or ``documents``).
        batch_size: ``train.batch_size`` (rows of fixed-shape micro-batches, and of validation batches).
        tokens_per_batch: ``train.tokens_per_batch`` (0: fixed shape).
        eval_batch_count: ``train.eval_batches``.
        seed: ``train.seed``.
        workers / prefetch: ``data.workers`` / ``data.prefetch``.
        pin_memory: page-locked batches (training on CUDA).
    """
    val, note = validation_batches(data, seq_len, packing, batch_size, eval_batch_count, seed)
    if packing == "windows":
        train = TokenWindows(data.train_tokens, seq_len)
        return DataPipeline(BatchLoader(BatchSampler(train, batch_size, seed), seed, workers, prefetch, pin_memory),
                            val, f"{len(train)} training windows of {seq_len} tokens", note)
    chunks = DocumentChunks(data.train_tokens, data.eos_id, seq_len)
    budget = f"micro-batches of <= {tokens_per_batch} tokens" if tokens_per_batch else f"rows of {seq_len} tokens"
    return DataPipeline(
        BatchLoader(DocumentBatches(chunks, batch_size, tokens_per_batch, seed), seed, workers, prefetch, pin_memory),
        val, f"{chunks.num_documents} training documents in {len(chunks)} chunks of <= {seq_len} tokens, {budget}")
