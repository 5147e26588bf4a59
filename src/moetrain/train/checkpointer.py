"""``Checkpointer``: the one way a :class:`~moetrain.train.state.TrainState` is saved and loaded, by the trainer
(one process or a torchrun job), by the parallel launcher, and by eval / generate / export.

Two formats, one store. Either way the files go through :class:`~moetrain.train.checkpoint.CheckpointStore`
(manifest with the size and SHA-256 of every file, atomic write locally, manifest-last on object stores) and are
read back only after every byte verifies.

- **single** (a single process): ``model.safetensors`` (the model's tensors, tied ones once) and
  ``train_state.pt`` (:meth:`TrainState.replicated_state_dict` plus ``optimizer``: the optimizer's own
  ``state_dict()``).
- **sharded** (a torchrun job): ``torch.distributed.checkpoint`` files (``.metadata``, ``__<rank>_0.distcp``,
  ``moetrain.json``: :mod:`moetrain.parallel.dcp`) holding the model and the optimizer keyed by FQN, expert shards
  as global-shape DTensors; and ``train_state.pt`` without ``optimizer``.

Both add ``tokenizer.json`` and ``config.json`` (the run's, so a checkpoint is self-contained). Loading reads either
format into any layout: sharded into one process or another EP size (DCP reshards), single into a sharded model
(expert rows and their AdamW moments sliced to this rank). The on-disk layout is that of format 1, unchanged since
before the ``Checkpointer`` existed (tests/data/legacy_checkpoints holds checkpoints written by that code).

Today the sharded files of every rank are gathered on rank 0, which writes them (``dcp.save_files``). Issue 17
(FSDP2, pipeline parallel) replaces that by each rank writing and hashing its own shards into the checkpoint
directory (a per-rank manifest section), without changing this class's API.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from moetrain.errors import CheckpointError
from moetrain.parallel import dcp
from moetrain.parallel.dcp import ShardLayout
from moetrain.train.checkpoint import (
    MODEL_FILE,
    STATE_FILE,
    CheckpointStore,
    LoadedCheckpoint,
    checkpoint_name,
    encode_model,
    encode_state,
    load_model_weights,
)
from moetrain.train.state import TrainState

SINGLE, SHARDED = "single", "sharded"


def checkpoint_format(files: dict[str, bytes]) -> str:
    """``"sharded"`` for DCP files, else ``"single"``."""
    return SHARDED if dcp.is_dcp_files(files) else SINGLE


class Checkpointer:
    """Saves and loads a :class:`TrainState` under one checkpoint location.

    Args:
        url: a local directory or an fsspec URL (see :class:`~moetrain.train.checkpoint.CheckpointStore`).
        layout: this rank's :class:`~moetrain.parallel.dcp.ShardLayout` (mesh and expert shards); default one
            process. The format written follows it: sharded when distributed, single otherwise.
        keep: after each save, keep the newest ``keep`` checkpoints (0: all) ...
        milestone_every: ... plus those of steps that are multiples of this (0: none).
    Raises:
        CheckpointError: an unknown or unavailable storage protocol.
    """

    def __init__(self, url: str | os.PathLike, layout: ShardLayout | None = None, keep: int = 0,
                 milestone_every: int = 0):
        self.store = CheckpointStore(url)
        self.layout = layout if layout is not None else ShardLayout.single()
        self.keep, self.milestone_every = keep, milestone_every

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.url!r}, world_size={self.layout.mesh.world_size})"

    # -- finding -----------------------------------------------------------------------------------------------
    def latest(self, warn: Callable[[str], None] = print) -> tuple[LoadedCheckpoint | None, list[str]]:
        """The newest checkpoint that verifies (read once, every file checked) and the names of newer ones that
        did not (each reported through ``warn``)."""
        return self.store.latest_valid(warn=warn)

    # -- saving ------------------------------------------------------------------------------------------------
    def encode(self, state: TrainState) -> dict[str, bytes]:
        """The weight and state files of ``state`` in this layout's format. A collective when distributed: every
        rank calls it; rank 0 gets every rank's files, the other ranks ``{}``."""
        if not self.layout.distributed:
            return {MODEL_FILE: encode_model(state.model),
                    STATE_FILE: encode_state(state.replicated_state_dict(include_optimizer=True))}
        files = dcp.save_files(state.model, state.optimizer, self.layout)
        if self.layout.is_main:
            files[STATE_FILE] = encode_state(state.replicated_state_dict())
        return files

    def save(self, state: TrainState, run_files: dict[str, bytes] | None = None) -> str:
        """Write checkpoint ``step_{state.step:08d}`` (rank 0 writes; every rank must call: a collective when
        distributed), then prune old ones; returns its location.

        Args:
            state: what to save.
            run_files: more files for the checkpoint (``tokenizer.json``, ``config.json``).
        """
        files = self.encode(state)
        if not self.layout.is_main:
            return self.store.location(checkpoint_name(state.step))
        files.update(run_files or {})
        where = self.store.save(state.step, files)
        if self.keep > 0:
            self.store.prune(self.keep, self.milestone_every)
        return where

    # -- loading -----------------------------------------------------------------------------------------------
    def load(self, ckpt: LoadedCheckpoint, state: TrainState) -> dict[str, Any]:
        """Load a verified checkpoint of either format into ``state`` (model, optimizer, schedule, data position,
        RNG, step, counters), resharding to this layout; returns the ``train_state.pt`` content (its ``monitor``
        entry is for the caller's routing monitor, see :meth:`TrainState.load_replicated`).

        Raises:
            CheckpointError: it does not fit (another model shape, a missing or extra tensor, an optimizer of
                other parameters): the message names the file.
        """
        saved = ckpt.train_state()
        self.load_weights(ckpt, state.model, state.optimizer, saved)
        state.load_replicated(saved, f"{ckpt.location}/{STATE_FILE}")
        return saved

    def load_weights(self, ckpt: LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                     saved: dict[str, Any] | None = None) -> None:
        """Load the model (and, given one, the optimizer) of ``ckpt`` into this layout
        (:func:`load_weights`)."""
        load_weights(ckpt, model, optimizer, self.layout, saved)


def load_weights(ckpt: LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 layout: ShardLayout, saved: dict[str, Any] | None = None) -> None:
    """Load the model (and, given one, the optimizer) of a verified checkpoint of either format into ``layout``:
    sharded files are resharded by DCP; single-format expert tensors and their AdamW moments are sliced to this
    rank's rows.

    Args:
        saved: ``ckpt.train_state()`` if already read (the single format's optimizer is in it).
    Raises:
        CheckpointError: another model shape, a missing or extra tensor, or an optimizer of other parameters; the
            message names the file.
    """
    if checkpoint_format(ckpt.files) == SHARDED:
        dcp.load_files(ckpt.files, model, optimizer, layout, where=ckpt.location)
        return
    tensors = {k: layout.local_rows(k, v) for k, v in ckpt.model_tensors().items()}
    load_model_weights(model, tensors, f"{ckpt.location}/{MODEL_FILE}")
    if optimizer is None:
        return
    where = f"{ckpt.location}/{STATE_FILE}"
    try:
        state = (saved if saved is not None else ckpt.train_state())["optimizer"]
        if layout.plan:  # index-keyed: name each entry by its parameter to slice expert moments
            names = {p: n for n, p in model.named_parameters()}
            index_names = [names[p] for g in optimizer.param_groups for p in g["params"]]
            for index, entry in state["state"].items():
                name = index_names[int(index)]
                state["state"][index] = {k: layout.local_rows(name, v) if torch.is_tensor(v) else v
                                         for k, v in entry.items()}
        optimizer.load_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise CheckpointError(f"{where}: does not fit this run: "
                              f"{e.__class__.__name__}: {str(e).splitlines()[0]}") from None


def load_latest_model(url: str | os.PathLike, model: nn.Module,
                      warn: Callable[[str], None] = print) -> LoadedCheckpoint:
    """Load the newest valid checkpoint under ``url`` (either format, resharded to one process) into ``model``
    (for eval / generate / export); returns that checkpoint (its step, location and verified files: drop it once
    read, it holds the weights' bytes too).

    Raises:
        CheckpointError: no checkpoint verifies, or it is from a different model shape.
    """
    checkpointer = Checkpointer(url)
    ckpt, skipped = checkpointer.latest(warn=warn)
    if ckpt is None:
        why = f" ({len(skipped)} failed verification, see the warnings)" if skipped else ""
        raise CheckpointError(f"no usable checkpoint in {checkpointer.store.url}{why}")
    checkpointer.load_weights(ckpt, model)
    return ckpt
