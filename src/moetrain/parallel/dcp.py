"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes its own expert shards,
replicated tensors are written once, and loading reshards to any EP size, one process included.

Legend: E = experts, E_l = E / ep local experts.

An expert shard [E_l, ...] is presented to DCP as a ``DTensor`` of global shape [E, ...] placed ``(Replicate(),
Shard(0))`` on the ``(dp, ep)`` mesh, sharing storage with the parameter (no copy); every other tensor is a plain
tensor, which DCP treats as replicated. The checkpoint's metadata thus describes global tensors and chunk offsets
only, so any process count can read it: an EP=4 checkpoint loads at EP=2 or in one process (whole [E, ...]
tensors), and an EP=1 checkpoint loads at EP=4. The AdamW moments of an expert shard are sharded the same way.

Layout of one checkpoint directory: DCP's ``.metadata`` and ``__<rank>_0.distcp`` files, plus ``moetrain.json``
(step, world size, ep) written by rank 0 last, so its presence marks a complete checkpoint. Inside the trainer's
checkpoints these files sit beside ``train_state.pt`` and the manifest of
:class:`~moetrain.train.checkpoint.CheckpointStore`; :class:`~moetrain.train.checkpointer.Checkpointer` decides
which format to write and reads both.
"""

from __future__ import annotations

import io
import json
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from moetrain.errors import CheckpointError
from moetrain.parallel.comm import named_collective
from moetrain.parallel.mesh import ParallelMesh, single_process
from moetrain.parallel.sharding import ExpertShard

MARKER = "moetrain.json"


def is_dcp_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a complete checkpoint written by :func:`save`."""
    return (path / MARKER).is_file() and (path / ".metadata").is_file()


@contextmanager
def _quiet(mesh: ParallelMesh) -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning: for one process it is."""
    with warnings.catch_warnings():
        if not mesh.distributed:
            warnings.filterwarnings("ignore", message=".*single process.*")
        yield


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


@dataclass(frozen=True)
class ShardLayout:
    """How this rank's tensors map onto the global ones: the mesh and the expert shards.

    Today only routed-expert tensors are sharded (dim 0 over the EP group); every other tensor is replicated. This
    is the one place that says so: FSDP2 (issue 17) makes parameters DTensors that carry their own placement, and
    then :meth:`global_view` has nothing left to wrap.

    Attributes:
        mesh: this rank's mesh position.
        plan: ``{parameter name: ExpertShard}`` (:func:`moetrain.parallel.sharding.shard_experts`); empty: no
            sharding.
    """

    mesh: ParallelMesh
    plan: dict[str, ExpertShard] = field(default_factory=dict)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ShardLayout":
        """One process, nothing sharded."""
        return cls(single_process(device))

    @property
    def distributed(self) -> bool:
        return self.mesh.distributed

    @property
    def is_main(self) -> bool:
        return self.mesh.is_main

    def global_view(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself, or for an expert shard [E_l, ...] a DTensor view of it (no copy) of global shape
        [E, ...] placed ``(Replicate(), Shard(0))`` on the ``(dp, ep)`` mesh."""
        shard = self.plan.get(name)
        if isinstance(tensor, DTensor) or shard is None or not self.mesh.distributed or self.mesh.ep == 1:
            return tensor  # a DTensor (an FSDP2 parameter) already carries its placement
        shape = shard.global_shape(tensor.shape)
        return DTensor.from_local(tensor, self.mesh.mesh, [Replicate(), Shard(0)], run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))

    def local_rows(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor saved under ``name`` (an expert tensor [E, ...] or an optimizer
        moment of one); any other tensor unchanged."""
        shard = self.plan.get(name)
        if shard is None or full.dim() == 0 or full.shape[0] != shard.global_rows:
            return full
        return full[shard.offset : shard.offset + shard.local_rows]


def _param_names(model: nn.Module) -> dict[torch.Tensor, str]:
    # Keyed by Tensor (the parameters): it is indexed with the keys of ``optimizer.state`` (typed Tensor).
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


def model_state_dict(model: nn.Module, layout: ShardLayout) -> dict[str, torch.Tensor]:
    """What DCP writes for the model: ``model.state_dict()`` keyed by FQN, expert shards as global-shape DTensor
    views (the analogue of ``torch.distributed.checkpoint.state_dict.get_model_state_dict``)."""
    return {k: layout.global_view(k, v) for k, v in model.state_dict().items()}


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, layout: ShardLayout
                         ) -> dict[str, dict[str, Any]]:
    """What DCP writes for the optimizer: each parameter's state keyed by the parameter's FQN (not its index, so
    that it survives a change of layout), moments of expert shards as global-shape DTensor views (the analogue
    of ``get_optimizer_state_dict`` with flattened FQN keys)."""
    names = _param_names(model)
    return {
        names[p]: {k: layout.global_view(names[p], v) if torch.is_tensor(v) and v.shape == p.shape else v
                   for k, v in s.items()}
        for p, s in optimizer.state.items()
    }


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, layout: ShardLayout) -> dict[str, Any]:
    """The tensors DCP reads and writes: ``model`` and (with an optimizer) ``optim``."""
    state: dict[str, Any] = {"model": model_state_dict(model, layout)}
    if optimizer is not None:
        state["optim"] = optimizer_state_dict(model, optimizer, layout)
    return state


def _pickled(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, plan: dict[str, ExpertShard],
         mesh: ParallelMesh, extra: dict[str, Any] | None = None, layout: ShardLayout | None = None) -> None:
    """Write a checkpoint of the (sharded) model, its optimizer and ``extra`` (any picklable data: step,
    scheduler, sampler, RNG) into the directory ``path``. A collective: every rank calls it.

    Args:
        path: the checkpoint directory (created; shared by all ranks, e.g. on a shared file system).
        model: this rank's model.
        optimizer: this rank's optimizer, or ``None``.
        plan: the expert shards (:func:`moetrain.parallel.sharding.shard_experts`).
        mesh: this rank's mesh position.
        extra: replicated training state (one rank's copy is kept: it must be the same on every rank).
        layout: overrides ``ShardLayout(mesh, plan)`` (the FSDP2 engine's layout: ``moetrain.parallel.engine``).
    Raises:
        CollectiveError: a peer failed while the checkpoint was written.
    """
    path = Path(path)
    state = _state_dict(model, optimizer, layout or ShardLayout(mesh, plan))
    names = _param_names(model)
    groups = None
    if optimizer is not None:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
                  for g in optimizer.param_groups]
    # One opaque blob, so DCP does not flatten (and split) nested Python data.
    state["meta"] = _pickled({"param_groups": groups, "extra": extra or {}})
    with named_collective("torch.distributed.checkpoint.save (gather plans, write shards)"), _quiet(mesh):
        dcp.save(state, checkpoint_id=str(path))
    if mesh.is_main:
        marker = {"format": "torch.distributed.checkpoint", "world_size": mesh.world_size, "ep": mesh.ep,
                  "dp": mesh.dp, "experts_sharded": sorted(plan)}
        (path / MARKER).write_text(json.dumps(marker, indent=1))
    if mesh.distributed:
        with named_collective("barrier (checkpoint written)"):
            dist.barrier()


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, plan: dict[str, ExpertShard],
         mesh: ParallelMesh, layout: ShardLayout | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` at any EP / world size into this rank's (sharded) model and
    optimizer, in place; return the ``extra`` data.

    Raises:
        CheckpointError: not a complete checkpoint, or a tensor missing or of another shape (a different model).
        CollectiveError: a peer failed while loading.
    """
    path = Path(path)
    if not is_dcp_checkpoint(path):
        raise CheckpointError(f"{path}: not a complete distributed checkpoint (no {MARKER} or .metadata)")
    if optimizer is not None:
        materialise_optimizer_state(optimizer)
    state = _state_dict(model, optimizer, layout or ShardLayout(mesh, plan))
    state["meta"] = io.BytesIO()
    try:
        with named_collective("torch.distributed.checkpoint.load (read shards)"), _quiet(mesh):
            dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:  # DCP's report of missing keys and shape mismatches, from any rank
        reason = " ".join(str(e).split())[:500]
        raise CheckpointError(f"{path}: does not fit this model: {reason}") from None
    state["meta"].seek(0)
    meta = torch.load(state["meta"], weights_only=False)
    if optimizer is not None:
        names = _param_names(model)
        index = {names[p]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        params = {n: p for p, n in names.items()}
        # DCP loaded in place: a DTensor parameter (FSDP2) keeps its own (now filled) DTensor moments; a plain
        # parameter gets the local tensor of its global-shape view.
        local = {index[n]: {k: (optimizer.state[params[n]][k] if isinstance(params[n], DTensor)
                                and k in optimizer.state[params[n]] else
                                v.to_local() if isinstance(v, DTensor) else v) for k, v in s.items()}
                 for n, s in state["optim"].items()}
        # The saved groups' hyperparameters with this rank's own parameters: under pipeline parallelism the saving
        # rank held only its stages' parameters (the state itself is keyed by name, complete in the shards).
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[names[p]] for p in mine["params"]]}
                  for g, mine in zip(meta["param_groups"], optimizer.param_groups)]
        optimizer.load_state_dict({"state": local, "param_groups": groups})
    extra: dict[str, Any] = meta["extra"]  # what save() stored (meta comes from torch.load: Any)
    return extra


def is_dcp_files(files: dict[str, bytes]) -> bool:
    """Whether a checkpoint's files (as read from the checkpoint store) are a sharded checkpoint."""
    return ".metadata" in files and MARKER in files


def save_files(model: nn.Module, optimizer: torch.optim.Optimizer | None, layout: ShardLayout) -> dict[str, bytes]:
    """A checkpoint as files for :class:`~moetrain.train.checkpoint.CheckpointStore` (which verifies, writes
    atomically, and works on fsspec URLs): every rank writes its DCP shard into a private temporary directory, and
    rank 0 gathers ``.metadata``, the ``__<rank>_0.distcp`` shard of every rank and :data:`MARKER`.

    The gather moves the whole checkpoint through rank 0 (memory and network: fine for one node; a multi-node job
    with a shared file system would let each rank write its shard in place, same format). A collective.

    Returns:
        File name -> bytes on rank 0; ``{}`` on the other ranks.
    Raises:
        CollectiveError: a peer failed.
    """
    mesh = layout.mesh
    with tempfile.TemporaryDirectory(prefix="moetrain-dcp-") as tmp:
        save(Path(tmp), model, optimizer, layout.plan, mesh, layout=layout)
        mine = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    if not mesh.distributed:
        return mine
    gathered: list[dict[str, bytes]] | None = [{} for _ in range(mesh.world_size)] if mesh.is_main else None
    with named_collective("gather_object (checkpoint shards to rank 0)"):
        dist.gather_object(mine, gathered, dst=0)
    if not mesh.is_main:
        return {}
    assert gathered is not None  # rank 0 (is_main) allocated it above
    files: dict[str, bytes] = {}
    for part in gathered:
        files.update(part)
    return files


def load_files(files: dict[str, bytes], model: nn.Module, optimizer: torch.optim.Optimizer | None,
               layout: ShardLayout, where: str = "checkpoint") -> None:
    """Load a checkpoint given as files (from the checkpoint store) into this rank's model and optimizer; every
    rank needs all the files (each reads the chunks its shards overlap).

    Raises:
        CheckpointError: the files are not a complete sharded checkpoint, or do not fit this model.
    """
    with tempfile.TemporaryDirectory(prefix="moetrain-dcp-") as tmp:
        for name, raw in files.items():
            if name == MARKER or name == ".metadata" or name.endswith(".distcp"):
                (Path(tmp) / name).write_bytes(raw)
        try:
            load(Path(tmp), model, optimizer, layout.plan, layout.mesh, layout=layout)
        except CheckpointError as e:
            raise CheckpointError(str(e).replace(tmp, where)) from None
