"""The sharded checkpoint format with ``torch.distributed.checkpoint`` (DCP): each rank writes its own shards,
replicated tensors are written once, and loading reshards to any layout, one process included (what is written,
hashed and verified by whom: docs/scale-out.md, Checkpoints and resharding).

Legend: E = experts, E_l = E / ep local experts.

An expert shard [E_l, ...] is presented to DCP as a ``DTensor`` of global shape [E, ...] sharing storage with the
parameter (no copy; :meth:`ShardLayout.global_view`); every other tensor is a plain tensor, which DCP treats as
replicated, so the metadata describes global tensors and chunk offsets only. Files: DCP's ``.metadata``,
``__<rank>_0.distcp`` (each rank) and ``moetrain.json`` (world size, ep, dp), beside the ``train_state.pt`` and
manifest of :class:`~moetrain.train.checkpoint.CheckpointStore`; :class:`~moetrain.train.checkpointer.Checkpointer`
writes them (:func:`write_shards`) and reads them back (:func:`load_checkpoint`, :func:`load_full`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Container, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch import nn
from torch.futures import Future
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from moetrain.errors import CheckpointError
from moetrain.model.config import ModelConfig
from moetrain.parallel.comm import named_collective
from moetrain.parallel.layout import ExpertShard, ParallelMesh, single_process
from moetrain.parallel.meta_init import saved_name
from moetrain.train.checkpoint import CorruptCheckpoint, LoadedCheckpoint

MARKER = "moetrain.json"
METADATA = ".metadata"


def is_shard_file(name: str) -> bool:
    """Whether ``name`` is a DCP shard file (``__<rank>_<i>.distcp``): the files a rank verifies when it reads one."""
    return name.endswith(".distcp")


def own_shard_files(names: list[str], rank: int) -> list[str]:
    """The shard files among ``names`` written by ``rank`` (DCP's ``FileSystemWriter`` names them
    ``__<rank>_<i>.distcp``, ``i`` counting its write threads)."""
    return [n for n in names if is_shard_file(n) and n.startswith(f"__{rank}_")]


@contextmanager
def _quiet(mesh: ParallelMesh) -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning: for one process it is."""
    with warnings.catch_warnings():
        if not mesh.distributed:
            warnings.filterwarnings("ignore", message=".*single process.*")
        yield


@dataclass(frozen=True)
class ShardLayout:
    """How this rank's tensors map onto the global ones: the mesh and the expert shards. A DTensor parameter (an
    FSDP2 one) carries its own placement, a plain tensor is replicated, and an expert shard is presented as a view
    of the global [E, ...] tensor (:meth:`global_view`; replicas write the same chunks, which DCP deduplicates).

    Attributes:
        mesh: this rank's mesh position.
        plan: ``{parameter name: ExpertShard}`` (:func:`moetrain.parallel.layout.shard_experts`); empty: no
            sharding.
        expert_mesh: the FSDP2 engine's ``(ep, dp_shard)`` mesh of the expert shards
            (:attr:`~moetrain.parallel.layout.LayoutMesh.expert_global_mesh`); ``None``: experts not FSDP2-sharded.
    """

    mesh: ParallelMesh
    plan: dict[str, ExpertShard] = field(default_factory=dict)
    expert_mesh: DeviceMesh | None = None

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ShardLayout":
        """One process, nothing sharded."""
        return cls(single_process(device))

    def global_view(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself, or for an expert shard [E_l, ...] a DTensor view of it (no copy) of global shape
        [E, ...]: on :attr:`expert_mesh` rows split over ep, then over dp_shard (FSDP2's ``Shard(0)``) or columns
        over dp_shard (``Shard(1)``); without it placed ``(Replicate(), Shard(0))`` on the ``(dp, ep)`` mesh."""
        shard = self.plan.get(name)
        if shard is None or not self.mesh.distributed or self.mesh.ep == 1 or tensor.dim() == 0:
            return tensor
        mesh: DeviceMesh | None = self.expert_mesh
        if mesh is not None:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            inner = tensor.placements[-1] if isinstance(tensor, DTensor) else Replicate()
            placements = [Shard(0), inner]
        elif isinstance(tensor, DTensor):
            return tensor  # already carries its placement
        else:
            local, mesh, placements = tensor, self.mesh.mesh, [Replicate(), Shard(0)]
        shape = shard.global_shape(tensor.shape)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())


def _param_names(model: nn.Module) -> dict[torch.Tensor, str]:
    # Keyed by Tensor (the parameters): it is indexed with the keys of ``optimizer.state`` (typed Tensor). A
    # pipeline's last-stage copy of a tied embedding goes by the embedding's name (meta_init.saved_name).
    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig):
        return {p: saved_name(config, name) for name, p in model.named_parameters()}
    return {p: name for name, p in model.named_parameters()}


@torch.no_grad()
def materialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state tensors (so DCP can load into them) by one step with zero
    gradients and learning rate 0, which changes no parameter (AdamW: decay ``1 - 0 * wd``, update ``0 * m``)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for p, g in zip(params, grads):
        p.grad = g
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, layout: ShardLayout) -> dict[str, Any]:
    """What DCP reads and writes (the analogue of ``torch.distributed.checkpoint.state_dict.get_state_dict`` with
    flattened FQN keys): ``model``, ``model.state_dict()``, and with an optimizer ``optim``, each parameter's state
    keyed by the parameter's FQN (not its index, so that it survives a change of layout); expert shards and their
    moments as global-shape DTensor views."""
    state: dict[str, Any] = {"model": {k: layout.global_view(k, v) for k, v in model.state_dict().items()}}
    if optimizer is not None:
        names = _param_names(model)
        state["optim"] = {names[p]: {k: layout.global_view(names[p], v) if torch.is_tensor(v) and v.shape == p.shape
                                     else v for k, v in s.items()} for p, s in optimizer.state.items()}
    return state


def param_groups(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]] | None:
    """The optimizer's groups as saved: hyperparameters, and ``params`` as FQNs (this rank's parameters). Loading
    takes the hyperparameters only (a pipeline rank's own parameters go with them); ``None`` without optimizer."""
    if optimizer is None:
        return None
    names = _param_names(model)
    return [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
             "params": [names[p] for p in g["params"]]} for g in optimizer.param_groups]


def write_shards(checkpoint_id: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 layout: ShardLayout, remote: bool = False) -> None:
    """``dcp.save`` of the model and its optimizer into ``checkpoint_id``, a directory all ranks share (DCP's
    ``FileSystemWriter``, files fsynced) or an fsspec URL (``remote``: DCP's ``FsspecWriter``): this rank writes its
    own ``__<rank>_0.distcp``, rank 0 also ``.metadata``; what crosses the network is DCP's plans and write results
    (tensor names, offsets, sizes), never tensor bytes. A collective: every rank calls it. The optimizer's groups
    go in ``train_state.pt`` (:func:`param_groups`), which every rank reads anyway.

    Raises:
        MachineError: a rank's write failed (full or read-only disk), raised on every rank, naming the rank.
        CheckpointError: another failure while writing, on every rank.
        CollectiveError: a peer failed while the checkpoint was written.
    """
    from moetrain.runtime.oserrors import MachineError, os_error_line

    state = _state_dict(model, optimizer, layout)
    if remote:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer: FileSystemWriter = FsspecWriter(checkpoint_id, sync_files=False)  # an upload is durable on close
    else:
        writer = FileSystemWriter(checkpoint_id)
    # A tensor several ranks hold (replicated: buffers, step counters, EP's dense weights) is written by the lowest
    # of them, not by whichever has written least: then a rank that loads it reads (and verifies) that one file,
    # the first rank of its replica or stage, instead of a piece of every rank's.
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    try:
        with named_collective("torch.distributed.checkpoint.save (gather plans, write shards)"), _quiet(layout.mesh):
            dcp.save(state, storage_writer=writer, planner=planner)
    except CheckpointException as e:  # every rank raises DCP's report of every rank's failure
        rank = min(e.failures)
        first = e.failures[rank][0]
        if isinstance(first, OSError):
            raise MachineError(f"rank {rank}: {os_error_line(first, 'checkpoint shards', checkpoint_id)}") from None
        reason = (str(first).strip().splitlines() or [type(first).__name__])[0]
        raise CheckpointError(f"{checkpoint_id}: rank {rank} could not write its shards: {reason}") from None


def marker(layout: ShardLayout) -> bytes:
    """The content of :data:`MARKER` for a checkpoint written in ``layout``."""
    mesh = layout.mesh
    return json.dumps({"format": "torch.distributed.checkpoint", "world_size": mesh.world_size, "ep": mesh.ep,
                       "dp": mesh.dp, "experts_sharded": sorted(layout.plan)}, indent=1).encode()


class VerifiedReader(FileSystemReader):
    """DCP's ``FileSystemReader`` over one checkpoint directory that verifies, before reading, each shard file this
    rank's load plan touches (the files holding a chunk that overlaps a tensor this rank loads, from DCP's metadata:
    ``storage_data`` maps each chunk to its file), and nothing else. ``.metadata`` comes from bytes already verified.

    Args:
        path: the checkpoint directory DCP opens the shard files in (an object store's are first downloaded into it
            by ``verify``).
        metadata: the verified bytes of ``.metadata``.
        verify: called once with the sorted names of the shard files this rank reads, before any is read; raises
            :class:`~moetrain.train.checkpoint.CorruptCheckpoint` naming a file that does not match its manifest.
    """

    def __init__(self, path: str | Path, metadata: bytes, verify: Callable[[list[str]], None]):
        super().__init__(path)
        self._metadata, self._verify = metadata, verify
        self.files_read: list[str] = []

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # a rank-local metadata file: never written by this code
            raise FileNotFoundError(f"{self.path}: no rank-local metadata")
        metadata: Metadata = pickle.loads(self._metadata)  # DCP's own format (its reader unpickles the same bytes)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.files_read = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        self._verify(self.files_read)
        return super().read_data(plan, planner)


def _load_error(e: CheckpointException, where: str) -> CheckpointError:
    """One line for DCP's report of every rank's failure: a shard that did not verify (its file and the ranks that
    read it), else the first reason the checkpoint does not fit (a missing key, another shape)."""
    corrupt = {rank: exc for rank, (exc, _) in e.failures.items() if isinstance(exc, CorruptCheckpoint)}
    if corrupt:
        first = corrupt[min(corrupt)]
        ranks = sorted(r for r, exc in corrupt.items() if str(exc) == str(first))
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return CorruptCheckpoint(f"{first} (found by {who}, which read it)")
    reason = " ".join(str(e).split())[:500]
    return CheckpointError(f"{where}: does not fit this model: {reason}")


def _read(model: nn.Module, optimizer: torch.optim.Optimizer | None, layout: ShardLayout, where: str,
          reader: StorageReader, groups: list[dict[str, Any]] | None, state: dict[str, Any] | None = None) -> None:
    """``dcp.load`` into ``model`` and ``optimizer`` (in place) through ``reader`` (``state``: the tensors to load,
    default :func:`_state_dict`). The optimizer's groups are ``groups``, or ``None``: those of the pickled blob
    ``meta`` that checkpoints written before ``train_state.pt`` held them carry in DCP."""
    if optimizer is not None:
        materialise_optimizer_state(optimizer)
    if state is None:
        state = _state_dict(model, optimizer, layout)
    if groups is None:
        state["meta"] = io.BytesIO()
    try:
        with named_collective("torch.distributed.checkpoint.load (read shards)"), _quiet(layout.mesh):
            dcp.load(state, storage_reader=reader)
    except CheckpointException as e:  # DCP's report of every rank's failure: missing keys, shapes, a corrupt shard
        raise _load_error(e, where) from None
    if groups is None:
        state["meta"].seek(0)
        groups = torch.load(state["meta"], weights_only=False)["param_groups"]
    if optimizer is not None and "optim" in state:
        assert groups is not None  # a checkpoint with optimizer state names its groups
        _restore_optimizer(model, optimizer, state["optim"], groups)


# How AdamW runs (one fused kernel, a foreach or a per-tensor loop), not what it computes: this run's own choice
# (train.trainer.build_optimizer) outlives a checkpoint written by a run that chose otherwise.
IMPLEMENTATION_KEYS = ("fused", "foreach")


def saved_group(saved: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """A saved optimizer group's hyperparameters (without ``params`` and PyTorch's ``param_names``), with this
    run's implementation choices (:data:`IMPLEMENTATION_KEYS`) from ``mine``, the live group."""
    return {**{k: v for k, v in saved.items() if k not in ("params", "param_names")},
            **{k: mine[k] for k in IMPLEMENTATION_KEYS if k in mine}}


def _restore_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, dict[str, Any]],
                       saved_groups: list[dict[str, Any]]) -> None:
    names = _param_names(model)
    index = {names[p]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    params = {n: p for p, n in names.items()}
    # DCP loaded in place: a DTensor parameter (FSDP2) keeps its own (now filled) DTensor moments; a plain
    # parameter gets the local tensor of its global-shape view.
    local = {index[n]: {k: (optimizer.state[params[n]][k] if isinstance(params[n], DTensor)
                            and k in optimizer.state[params[n]] else
                            v.to_local() if isinstance(v, DTensor) else v) for k, v in s.items()}
             for n, s in loaded.items()}
    # The saved groups' hyperparameters with this rank's own parameters: under pipeline parallelism the saving
    # rank held only its stages' parameters (the state itself is keyed by name, complete in the shards).
    # (PyTorch's param_names, if saved, would name the saving layout's parameters: dropped.)
    groups = [{**saved_group(g, mine), "params": [index[names[p]] for p in mine["params"]]}
              for g, mine in zip(saved_groups, optimizer.param_groups)]
    optimizer.load_state_dict({"state": local, "param_groups": groups})


def is_dcp_files(files: Container[str]) -> bool:
    """Whether a checkpoint's file names (as its manifest lists them) are a sharded checkpoint's."""
    return METADATA in files and MARKER in files


def load_checkpoint(ckpt: LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    layout: ShardLayout, groups: list[dict[str, Any]] | None = None) -> list[str]:
    """Load a sharded checkpoint from the store into this rank's model and optimizer (a collective), verifying
    only the shard files this rank reads: each is hashed against the manifest first (size and SHA-256), on a local
    store in place, from an object store while downloading it into a temporary directory. A checkpoint whose
    bytes are all in memory already (``ckpt.deferred`` empty, every file verified) is read from those. Returns the
    shard files this rank read.

    Args:
        groups: the optimizer's :func:`param_groups` as saved beside the shards (``train_state.pt``); older
            checkpoints carry them in DCP (then ignored).

    Raises:
        CorruptCheckpoint: a shard file this rank or another reads is missing, truncated or altered; every rank
            raises it, naming the file and the ranks that found it.
        CheckpointError: the checkpoint does not fit this model (a missing or extra tensor, another shape).
        CollectiveError: a peer failed while loading.
    """
    with tempfile.TemporaryDirectory(prefix="moetrain-dcp-") as tmp:
        if not ckpt.deferred:  # every byte verified and in memory: DCP reads them from a private copy
            for name, raw in ckpt.files.items():
                if is_shard_file(name):
                    (Path(tmp) / name).write_bytes(raw)
        where = ckpt.local_dir if ckpt.deferred and ckpt.local_dir is not None else Path(tmp)

        def verify(files: list[str]) -> None:
            for name in files:
                if name in ckpt.deferred:
                    ckpt.verify_file(name, copy_to=None if where != Path(tmp) else Path(tmp) / name)
                elif name not in ckpt.files:  # DCP's metadata names a file the manifest does not list
                    raise CorruptCheckpoint(f"{ckpt.location}/{name}: not in the manifest (corrupt metadata?)")

        reader = VerifiedReader(where, ckpt.files[METADATA], verify)
        if "meta" in pickle.loads(ckpt.files[METADATA]).state_dict_metadata:
            groups = None  # written before train_state.pt held them: the blob in DCP
        elif groups is None:
            if optimizer is not None:
                raise CheckpointError(f"{ckpt.location}: the optimizer's groups are missing (train_state.pt)")
            groups = []  # weights only: none needed
        try:
            _read(model, optimizer, layout, ckpt.location, reader, groups)
        except CheckpointError as e:
            raise type(e)(str(e).replace(tmp, ckpt.location)) from None
        return reader.files_read


class MemoryReader(StorageReader):
    """A whole checkpoint held in memory (full tensors and picklable values by DCP's flattened keys, e.g.
    ``model.layers.0.attn.wq.weight``), read through DCP's load planner exactly like one on disk: every rank copies
    the chunks of its own shards out of the full tensors (no collective reading), so any layout DCP reshards to
    can take a one-process checkpoint.

    Args:
        flat: key -> tensor (one chunk: the whole tensor) or any other value (stored as DCP stores such values,
            ``torch.save`` bytes).
    """

    def __init__(self, flat: dict[str, Any]):
        super().__init__()
        self._flat: dict[str, Any] = {}
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for key, value in flat.items():
            if torch.is_tensor(value):
                value = value.detach()
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.size())
                entries[key] = TensorStorageMetadata(TensorProperties.create_from_tensor(value), value.size(), [chunk])
                self._flat[key] = value
            else:
                entries[key] = BytesStorageMetadata()
                buf = io.BytesIO()
                torch.save(value, buf)
                self._flat[key] = buf.getvalue()
        self._metadata = Metadata(state_dict_metadata=entries, storage_data={})

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # no rank-local metadata
            raise FileNotFoundError("in-memory checkpoint: no rank-local metadata")
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            value = self._flat[req.storage_index.fqn]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(value))
                continue
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                value = value.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            target.copy_(value)
            planner.commit_tensor(req, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[Any]) -> bool:
        return False


def load_full(tensors: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None, model: nn.Module,
              optimizer: torch.optim.Optimizer | None, layout: ShardLayout, where: str) -> None:
    """Load a one-process checkpoint (whole tensors: ``model.safetensors`` and the optimizer's index-keyed
    ``state_dict()``) into this rank's model and optimizer in any layout, through DCP's planner
    (:class:`MemoryReader`): FSDP2 shards, expert rows, a pipeline rank's stages alike. A collective.

    Args:
        tensors: FQN -> full tensor (a tied tensor under one of its names).
        optimizer_state: ``optimizer.state_dict()`` of the one-process run, its groups' ``param_names`` naming the
            parameters (written since this loader exists); without names, this rank's own optimizer order is
            assumed (a layout holding every parameter), or ``None`` (weights only).
        where: the file, for messages.
    Raises:
        CheckpointError: a tensor missing, extra or of another shape; optimizer state that does not fit.
    """
    if optimizer is not None and optimizer_state is not None:
        materialise_optimizer_state(optimizer)
    state = _state_dict(model, optimizer, layout)
    flat: dict[str, Any] = {f"model.{k}": v for k, v in tensors.items()}
    config = getattr(model, "config", None)
    if isinstance(config, ModelConfig) and config.tie_embeddings and "embed_tokens.weight" in tensors:
        flat.setdefault("model.lm_head.weight", tensors["embed_tokens.weight"])  # a pipeline's last-stage copy
    held = model.state_dict(keep_vars=True)
    first = {id(v): k for k, v in reversed(held.items())}  # a tied tensor: the name it is saved under
    for name in [k for k in state["model"] if k not in tensors and first[id(held[k])] != k]:
        del state["model"][name]  # the second name of a tied tensor: loaded through the first
    groups: list[dict[str, Any]] = []
    if optimizer is None or optimizer_state is None:
        state.pop("optim", None)
    else:
        saved = optimizer_state["param_groups"]
        names = [n for g in saved for n in g.get("param_names", [])]
        if not names:  # written before param_names: the order of this rank's optimizer, if it holds them all
            by_param = _param_names(model)
            names = [by_param[p] for g in optimizer.param_groups for p in g["params"]]
            if len(names) != sum(len(g["params"]) for g in saved):
                raise CheckpointError(f"{where}: its optimizer state does not name its parameters (written before "
                                      "param_names): it loads only into a layout holding every parameter")
        for index, entry in optimizer_state["state"].items():
            flat.update({f"optim.{names[int(index)]}.{k}": v for k, v in entry.items()})
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[int(i)] for i in g["params"]]}
                  for g in saved]
    _read(model, optimizer if "optim" in state else None, layout, where, MemoryReader(flat), groups, state)
