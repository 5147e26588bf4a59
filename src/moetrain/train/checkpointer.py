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

Both add ``tokenizer.json`` and ``config.json`` (the run's, so a checkpoint is self-contained).

Optimizer state (``optimizer_state``, the trainer's ``train.optimizer_state``): with ``"newest"`` (the default), once
a checkpoint is committed, the older ones kept beside it (single format, local storage) lose the ``optimizer`` entry
of their ``train_state.pt`` (AdamW's two moments per parameter: twice the fp32 weights' size), through
:meth:`~moetrain.train.checkpoint.CheckpointStore.replace_files` (crash-safe; their manifest's ``meta`` then says
``"optimizer_state": false``). Sharded checkpoints keep theirs (the moments sit in the same DCP shards as the
weights, so dropping them would mean rewriting every shard), as do checkpoints on object stores (no atomic rename).
Loading a checkpoint without optimizer state restores everything else and starts the moments afresh, with a one-line
warning naming the checkpoint.

Loading reads either
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
OPTIMIZER_STATES = ("newest", "all")


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
        optimizer_state: ``"newest"``: after each save, the older kept checkpoints lose their optimizer state
            (single format on local storage; see the module docstring); ``"all"``: every checkpoint keeps it.
    Raises:
        CheckpointError: an unknown or unavailable storage protocol.
        ValueError: ``optimizer_state`` is not one of :data:`OPTIMIZER_STATES`.
    """

    def __init__(self, url: str | os.PathLike[str], layout: ShardLayout | None = None, keep: int = 0,
                 milestone_every: int = 0, optimizer_state: str = "newest"):
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state: must be one of {OPTIMIZER_STATES}, got {optimizer_state!r}")
        self.store = CheckpointStore(url)
        self.layout = layout if layout is not None else ShardLayout.single()
        self.keep, self.milestone_every = keep, milestone_every
        self.optimizer_state = optimizer_state

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
        if self.optimizer_state == "newest":
            self.drop_old_optimizer_states(keep=checkpoint_name(state.step))
        return where

    def drop_old_optimizer_states(self, keep: str) -> list[str]:
        """Remove the optimizer state from every checkpoint but ``keep`` (the one just committed) and those newer
        than it: single format on local storage only, each verified first (a corrupt one is left for
        :meth:`latest` to report) and rewritten crash-safely (:meth:`CheckpointStore.replace_files`). Returns the
        names rewritten. A checkpoint already without it is recognised from its manifest alone (nothing read)."""
        if not self.store.local:
            return []
        done = []
        for name in self.store.names():
            if name >= keep:
                break
            manifest = self.store.manifest(name)
            if manifest is None or manifest.get("meta", {}).get("optimizer_state") is False:
                continue
            if STATE_FILE not in manifest.get("files", {}) or dcp.is_dcp_files(dict.fromkeys(manifest["files"], b"")):
                continue
            try:
                ckpt = self.store.read_verified(name)
                saved = ckpt.train_state()
            except CheckpointError:
                continue
            if saved.pop("optimizer", None) is None:
                continue
            if self.store.replace_files(ckpt, {STATE_FILE: encode_state(saved)}, {"optimizer_state": False}):
                done.append(name)
        return done

    # -- loading -----------------------------------------------------------------------------------------------
    def load(self, ckpt: LoadedCheckpoint, state: TrainState,
             warn: Callable[[str], None] = print) -> dict[str, Any]:
        """Load a verified checkpoint of either format into ``state`` (model, optimizer, schedule, data position,
        RNG, step, counters), resharding to this layout; returns the ``train_state.pt`` content (its ``monitor``
        entry is for the caller's routing monitor, see :meth:`TrainState.load_replicated`). A checkpoint without
        optimizer state (``optimizer_state="newest"``, an older one) leaves the optimizer's moments empty (they
        start afresh at the next step) and says so through ``warn``.

        Raises:
            CheckpointError: it does not fit (another model shape, a missing or extra tensor, an optimizer of
                other parameters): the message names the file.
        """
        saved = ckpt.train_state()
        self.load_weights(ckpt, state.model, state.optimizer, saved, warn)
        state.load_replicated(saved, f"{ckpt.location}/{STATE_FILE}")
        if "optimizer" not in saved and state.optimizer is not None and state.scheduler is not None:
            # the next step's LR lives in the optimizer's param groups, which were not restored: take the schedule's
            for group, lr in zip(state.optimizer.param_groups, state.scheduler.get_last_lr()):
                group["lr"] = lr
        return saved

    def load_weights(self, ckpt: LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                     saved: dict[str, Any] | None = None, warn: Callable[[str], None] = print) -> None:
        """Load the model (and, given one, the optimizer) of ``ckpt`` into this layout
        (:func:`load_weights`)."""
        load_weights(ckpt, model, optimizer, self.layout, saved, warn)


def load_weights(ckpt: LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 layout: ShardLayout, saved: dict[str, Any] | None = None,
                 warn: Callable[[str], None] = print) -> None:
    """Load the model (and, given one, the optimizer) of a verified checkpoint of either format into ``layout``:
    sharded files are resharded by DCP; single-format expert tensors and their AdamW moments are sliced to this
    rank's rows. A single-format checkpoint without optimizer state leaves ``optimizer`` as it is (fresh: its
    moments start from zero at the next step) and calls ``warn`` with one line naming the checkpoint.

    Args:
        saved: ``ckpt.train_state()`` if already read (the single format's optimizer is in it).
        warn: where the no-optimizer-state warning goes.
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
    saved = saved if saved is not None else ckpt.train_state()
    if "optimizer" not in saved:
        warn(f"warning: checkpoint {ckpt.location} holds no optimizer state (train.optimizer_state=newest keeps it "
             "in the newest checkpoint only): weights loaded, AdamW moments start afresh")
        return
    try:
        state = saved["optimizer"]
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


def load_latest_model(url: str | os.PathLike[str], model: nn.Module,
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
