"""``Checkpointer``: the one way a :class:`~moetrain.train.state.TrainState` is saved and loaded, by the trainer
(one process or a torchrun job), by the parallel launcher, and by eval / generate / export.

Two formats (layout and who writes what: docs/train-state.md), one
:class:`~moetrain.train.checkpoint.CheckpointStore`: **single** (one process: ``model.safetensors``, and
``train_state.pt`` with ``optimizer``) and **sharded** (a torchrun job: DCP files keyed by FQN, and
``train_state.pt`` with ``optimizer_groups`` instead). Either loads into any layout (DCP reshards). A sharded run's
local checkpoint location must be a file system every rank sees; an object store (``s3://...``) needs nothing shared.
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from moetrain.errors import CheckpointError, MoetrainError
from moetrain.parallel import dcp
from moetrain.parallel.comm import named_collective
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
# train_state.pt of the sharded format: the optimizer's groups (hyperparameters, FQNs), dcp.param_groups of rank 0
OPTIMIZER_GROUPS = "optimizer_groups"
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
            (single format on local storage; docs/checkpoints.md); ``"all"``: every checkpoint keeps it.
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
    def latest(self, warn: Callable[[str], None] = print, before: str | None = None
               ) -> tuple[LoadedCheckpoint | None, list[str]]:
        """The newest checkpoint (older than ``before`` if given) that verifies and the names of newer ones that did
        not (each reported through ``warn``). A sharded checkpoint's shard files are only checked for presence and
        size here; each is hashed by the ranks that read it in :meth:`load`
        (:class:`~moetrain.train.checkpoint.CorruptCheckpoint` for a bad one)."""
        return self.store.latest_valid(warn=warn, defer=dcp.is_shard_file, before=before)

    # -- saving ------------------------------------------------------------------------------------------------
    def save(self, state: TrainState, run_files: dict[str, bytes] | None = None) -> str:
        """Write checkpoint ``step_{state.step:08d}`` (every rank must call: a collective when distributed, each rank
        writing its own shards), then prune old ones (rank 0); returns its location.

        Args:
            state: what to save.
            run_files: more files for the checkpoint (``tokenizer.json``, ``config.json``; rank 0's are written).
        Raises:
            MachineError: a write failed (full or read-only disk); nothing published, earlier checkpoints intact.
            CheckpointError: a rank's shards are not where rank 0 looks (no shared file system), or another rank's
                failure.
        """
        if self.layout.mesh.distributed:
            where = save_sharded(self.store, state, self.layout, run_files or {})
            if not self.layout.mesh.is_main:
                return where
        else:
            where = self.store.save(state.step, {
                MODEL_FILE: encode_model(state.model),
                STATE_FILE: encode_state(state.replicated_state_dict(include_optimizer=True)), **(run_files or {})})
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
            if STATE_FILE not in manifest.get("files", {}) or dcp.is_dcp_files(manifest["files"]):
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
        load_weights(ckpt, state.model, state.optimizer, self.layout, saved, warn)
        state.load_replicated(saved, f"{ckpt.location}/{STATE_FILE}")
        if "optimizer" not in saved and state.optimizer is not None and state.scheduler is not None:
            # the next step's LR lives in the optimizer's param groups, which were not restored: take the schedule's
            for group, lr in zip(state.optimizer.param_groups, state.scheduler.get_last_lr()):
                group["lr"] = lr
        return saved


def load_weights(ckpt: LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 layout: ShardLayout, saved: dict[str, Any] | None = None,
                 warn: Callable[[str], None] = print) -> None:
    """Load the model (and, given one, the optimizer) of a verified checkpoint of either format into ``layout``:
    sharded files through DCP (:func:`moetrain.parallel.dcp.load_checkpoint`), a single-format checkpoint as it is in
    one process or through DCP's planner into a distributed layout (:func:`moetrain.parallel.dcp.load_full`). A
    checkpoint without optimizer state leaves ``optimizer`` fresh and says so through ``warn``.

    Args:
        saved: ``ckpt.train_state()`` if already read (the single format's optimizer is in it).
        warn: where the no-optimizer-state warning goes.
    Raises:
        CorruptCheckpoint: a sharded checkpoint's shard file that a rank reads does not match the manifest.
        CheckpointError: another model shape, a missing or extra tensor, or an optimizer of other parameters; the
            message names the file.
    """
    if optimizer is not None:
        saved = saved if saved is not None else ckpt.train_state()
    if checkpoint_format(ckpt.files) == SHARDED:
        dcp.load_checkpoint(ckpt, model, optimizer, layout, (saved or {}).get(OPTIMIZER_GROUPS))
        return
    optim = saved.get("optimizer") if saved is not None and optimizer is not None else None
    if layout.mesh.distributed:
        dcp.load_full(ckpt.model_tensors(), optim, model, optimizer, layout, ckpt.location)
    else:
        load_model_weights(model, ckpt.model_tensors(), f"{ckpt.location}/{MODEL_FILE}")
    if optimizer is None:
        return
    if optim is None:
        warn(f"warning: checkpoint {ckpt.location} holds no optimizer state (train.optimizer_state=newest keeps it "
             "in the newest checkpoint only): weights loaded, AdamW moments start afresh")
        return
    if layout.mesh.distributed:
        return
    try:  # PyTorch's param_names (written since the DCP route reads them) would stay in the groups: dropped
        optimizer.load_state_dict({**optim, "param_groups": [{**dcp.saved_group(g, mine), "params": g["params"]}
                                                             for g, mine in zip(optim["param_groups"],
                                                                                optimizer.param_groups)]})
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise CheckpointError(f"{ckpt.location}/{STATE_FILE}: does not fit this run: "
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
    load_weights(ckpt, model, None, checkpointer.layout)
    return ckpt


T = TypeVar("T")


def _from_rank0(rank0: Callable[[], T] | None, what: str) -> T:
    """``rank0()`` run on rank 0 (``None`` elsewhere) and its result broadcast to every rank (a few bytes: a path,
    a location). An error on rank 0 is raised there and, as a :class:`MoetrainError`, on every other rank too."""
    box: list[Any] = [None]
    error: BaseException | None = None
    if rank0 is not None:
        try:
            box[0] = ("ok", rank0())
        except Exception as e:  # noqa: BLE001 -- reported to the other ranks, then re-raised here
            error = e
            box[0] = ("error", e if isinstance(e, MoetrainError) else CheckpointError(f"rank 0: {e}"))
    with named_collective(f"broadcast_object_list ({what})"):
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "error":
        raise value
    result: T = value
    return result


def save_sharded(store: CheckpointStore, state: TrainState, layout: ShardLayout, run_files: dict[str, bytes]) -> str:
    """Write checkpoint ``state.step`` of a distributed layout (a collective): rank 0 opens the staging location
    (:meth:`CheckpointStore.begin`) and broadcasts it; every rank writes its shards there
    (:func:`moetrain.parallel.dcp.write_shards`) and hashes them as stored; rank 0 gathers the digests, writes
    ``train_state.pt``, ``moetrain.json``, ``run_files`` and the manifest, publishes (:meth:`CheckpointStore.commit`)
    and tells every rank the outcome. Returns the checkpoint's location on every rank.

    Raises:
        MachineError: a write failed on some rank (every rank raises).
        CheckpointError: a rank's files are not where rank 0 looks, or another failure (every rank raises).
    """
    mesh, main = layout.mesh, layout.mesh.is_main
    staging = _from_rank0((lambda: store.begin(state.step)) if main else None, "checkpoint staging location")
    try:
        dcp.write_shards(staging.checkpoint_id, state.model, state.optimizer, layout, remote=not store.local)
    except BaseException:
        if main:
            store.abort(staging)
        raise
    # Size and SHA-256 of this rank's shard files, read back from the store: what the manifest will say, and this
    # rank's check of what it wrote (a one-line reason instead if that failed).
    mine: dict[str, dict[str, Any]] | str
    try:
        mine = {f: store.digest(staging, f) for f in dcp.own_shard_files(store.staged_files(staging), mesh.rank)}
    except OSError as e:
        from moetrain.runtime.oserrors import os_error_line

        mine = f"rank {mesh.rank}: {os_error_line(e)}"
    parts: list[Any] | None = [None] * mesh.world_size if main else None
    with named_collective("gather_object (checkpoint shard digests to rank 0)"):
        dist.gather_object(mine, parts, dst=0)

    def publish() -> str:
        """Rank 0: the manifest of every rank's digests, ``.metadata`` and the replicated files; publish."""
        assert parts is not None  # rank 0 allocated it
        try:
            digests: dict[str, dict[str, Any]] = {}
            for part in parts:
                if isinstance(part, str):  # that rank failed to hash its files
                    raise CheckpointError(f"checkpoint {staging.name}: {part}")
                digests.update(part)
            lost = sorted(set(digests) - set(store.staged_files(staging)))
            if lost:
                raise CheckpointError(
                    f"train.checkpoint_url: {lost[0]} (written by rank {lost[0][2:].split('_')[0]}) is not in "
                    f"{staging.path} as rank 0 sees it: a sharded run's local checkpoint directory must be on a file "
                    "system every rank shares (or use an object store URL)")
            digests[dcp.METADATA] = store.digest(staging, dcp.METADATA)
            replicated = {**state.replicated_state_dict(),
                          OPTIMIZER_GROUPS: dcp.param_groups(state.model, state.optimizer)}
            files = {STATE_FILE: encode_state(replicated), dcp.MARKER: dcp.marker(layout), **run_files}
            return store.commit(state.step, staging, files, digests)
        except BaseException:
            store.abort(staging)
            raise

    return _from_rank0(publish if main else None, "checkpoint published")
