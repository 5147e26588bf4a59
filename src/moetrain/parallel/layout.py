"""The ``pp x dp_replicate x dp_shard x ep`` device mesh of the FSDP2 engine, from the ``parallel`` config and the
``torchrun`` environment (what each dimension shards: docs/scale-out.md, The mesh).

Legend: P = pp (pipeline stages), R = dp_replicate (HSDP replicas), S = dp_shard (FSDP shards), X = ep (expert
parallel), W = P * R * S * X = WORLD_SIZE.

Ranks fill a ``(P, R, S, X)`` grid, ``rank = ((p * R + r) * S + s) * X + x``: an EP group is X consecutive ranks
(one node's GPUs when X <= nproc_per_node), pipeline stages are the outermost dimension (as in torchtitan).
Every process group is created with ``new_group(timeout=parallel.timeout_s)`` and wrapped by
``DeviceMesh.from_group``: ``init_device_mesh`` would give sub-groups the backend default time-out (30 min).
The trainer and ``moetrain serve parallel.ep=N`` both join the job and build the mesh through
:func:`init_layout_mesh`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moetrain.errors import ConfigError
from moetrain.moe.layer import MoELayer
from moetrain.parallel.comm import named_collective
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.exchange import all_gather_rows
from moetrain.train.restart import torchrun_restart


@dataclass(frozen=True)
class Layout:
    """The sizes of the four mesh dimensions (no process groups; :func:`build_layout_mesh` makes those).

    Attributes:
        pp / dp_replicate / dp_shard / ep: P, R, S, X of the module legend.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1

    @classmethod
    def from_config(cls, config: ParallelConfig, world: int) -> "Layout":
        """Sizes for ``world`` ranks: ``dp_replicate = 0`` takes the rest of the world.

        Raises:
            ConfigError: the world size is not ``pp * dp_replicate * dp_shard * ep`` (names the fields and values).
        """
        fixed = config.pp * config.dp_shard * config.ep
        replicate = config.dp_replicate or world // fixed
        if replicate < 1 or fixed * replicate != world:
            need = fixed * config.dp_replicate if config.dp_replicate else f"a multiple of {fixed}"
            raise ConfigError(
                f"parallel: world size {world} (torchrun --nproc_per_node x --nnodes) is not {need} = pp * "
                f"dp_replicate * dp_shard * ep = {config.pp} * {config.dp_replicate or '(the rest)'} * "
                f"{config.dp_shard} * {config.ep}; change parallel.pp / dp_shard / ep / dp_replicate or the number of "
                "processes")
        return cls(pp=config.pp, dp_replicate=replicate, dp_shard=config.dp_shard, ep=config.ep)

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.ep

    @property
    def data_parallel(self) -> int:
        """Ranks per stage that read different data (R * S * X)."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def grid(self) -> torch.Tensor:
        """[P, R, S, X] int64: the global rank at each coordinate."""
        return torch.arange(self.world).view(self.pp, self.dp_replicate, self.dp_shard, self.ep)

    def describe(self) -> str:
        """One line: the sizes and what each dimension shards."""
        return (f"mesh pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x ep {self.ep} "
                f"= {self.world} ranks; non-expert parameters sharded over {self.dp_shard * self.ep} ranks "
                f"(dp_shard x ep), expert shards over {self.dp_shard} (dp_shard), replicated x{self.dp_replicate}; "
                f"{self.data_parallel} data-parallel ranks per stage")


@dataclass(frozen=True)
class ParallelMesh:
    """Expert parallelism's view of this rank (:attr:`LayoutMesh.ep_mesh`): what the EP dispatchers, the expert
    slicing and checkpoints read. One process is the trivial view (:func:`single_process`), with no groups.

    Attributes:
        world_size / rank: all ranks, this rank.
        ep / ep_rank: expert-parallel size X and this rank's index x in its EP group.
        dp / dp_rank: the R * S ranks of the stage holding the same experts (the replicas of this rank's expert
            shard) and this rank's index r * S + s among them.
        device: the rank's device (``cuda:LOCAL_RANK`` under NCCL).
        mesh: ``("dp", "ep")`` DeviceMesh of this pipeline stage's R * S * X ranks (``None`` for one process).
        ep_group / dp_group: process groups of this rank's EP group and of the replicas of its experts.
    """

    world_size: int
    rank: int
    ep: int
    ep_rank: int
    dp: int
    dp_rank: int
    device: torch.device
    mesh: DeviceMesh | None = None
    ep_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that writes logs, metrics and run files."""
        return self.rank == 0

    def local_experts(self, num_experts: int) -> range:
        """Global ids of the experts this rank holds: ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``.

        Raises:
            ConfigError: ``ep`` does not divide ``num_experts``.
        """
        if num_experts % self.ep:
            raise ConfigError(f"parallel.ep: {self.ep} does not divide model.moe.num_experts={num_experts}")
        per = num_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)


def single_process(device: torch.device | str = "cpu") -> ParallelMesh:
    """The trivial view of one process: no process group, every expert local."""
    return ParallelMesh(world_size=1, rank=0, ep=1, ep_rank=0, dp=1, dp_rank=0, device=torch.device(device))


@dataclass(frozen=True)
class ExpertShard:
    """One sliced expert tensor: this rank holds rows ``[offset, offset + local_rows)`` of ``global_rows`` along
    dim 0 (the expert dimension)."""

    offset: int
    local_rows: int
    global_rows: int

    def global_shape(self, local_shape: torch.Size) -> torch.Size:
        return torch.Size((self.global_rows, *local_shape[1:]))


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """(qualified name, module) of every :class:`~moetrain.moe.layer.MoELayer` in ``model``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def shard_experts(model: nn.Module, mesh: ParallelMesh) -> dict[str, ExpertShard]:
    """Keep this rank's E / ep consecutive experts of every MoE layer: every routed-expert parameter ``[E, ...]``
    becomes its slice ``[E_l, ...]`` (E_l = E / ep); shared experts are not routed and stay whole. On a
    meta-device model (the trainer's) the slice is a meta tensor too, materialised afterwards from global indices
    (:func:`moetrain.parallel.meta_init.materialise` with the returned plan); on a materialised one (serving) it
    is a copy, which drops the full tensor's storage.

    Args:
        model: a model whose experts are whole.
        mesh: this rank's EP view (``ep``, ``ep_rank``).
    Returns:
        ``{parameter name: ExpertShard}`` for every sliced parameter (empty when ``ep == 1``: nothing to slice).
    Raises:
        ConfigError: ``ep`` does not divide a layer's expert count, or an expert tensor lacks one row per expert.
    """
    plan: dict[str, ExpertShard] = {}
    if mesh.ep == 1:
        return plan
    for layer_name, layer in moe_layers(model):
        num_experts = layer.config.num_experts
        local = mesh.local_experts(num_experts)
        for pname, param in list(layer.experts.named_parameters(recurse=False)):
            if param.shape[0] != num_experts:
                raise ConfigError(
                    f"parallel.ep: {layer_name}.experts.{pname} has {param.shape[0]} rows, expected one per expert "
                    f"({num_experts}); cannot shard it"
                )
            piece = param.detach()[local.start : local.stop].clone()
            setattr(layer.experts, pname, nn.Parameter(piece, requires_grad=param.requires_grad))
            prefix = f"{layer_name}." if layer_name else ""
            plan[f"{prefix}experts.{pname}"] = ExpertShard(local.start, len(local), num_experts)
    return plan


def gather_full(local: torch.Tensor, shard: ExpertShard, mesh: ParallelMesh) -> torch.Tensor:
    """The full ``[E, ...]`` tensor from every EP rank's ``[E_l, ...]`` slice (an all-gather over the EP group;
    for checks and exports, not the training path)."""
    if mesh.ep == 1:
        return local.detach().clone()
    return all_gather_rows(local.detach(), mesh.ep_group, mesh.ep, "all_gather (expert weights)")


@dataclass
class LayoutMesh:
    """This rank's place in the mesh, with its process groups (all ``None`` for one process).

    Attributes:
        layout: the sizes.  rank: global rank.  coords: (p, r, s, x).  device: this rank's device.
        ep_mesh: a :class:`ParallelMesh` view for the EP dispatchers and expert slicing (``ep``, ``ep_rank``,
            ``ep_group``; ``dp_group`` = the R * S ranks replicating this rank's experts).
        dense_mesh: FSDP2 mesh of the non-expert parameters: ``("dp_replicate", "dp_shard_ep")`` when R > 1, else
            ``("dp_shard_ep",)``.
        expert_mesh: FSDP2 mesh of the expert shards: ``("dp_replicate", "dp_shard")`` or ``("dp_shard",)``.
        stage_group: the R * S * X data-parallel ranks of this pipeline stage (count and loss reductions).
        pp_group: the P ranks of this rank's pipeline (same r, s, x).
        pp_ranks: global ranks of this rank's pipeline, stage order.
        expert_global_mesh: ``("ep", "dp_shard")`` mesh of this replica and stage: an expert tensor's rows are
            split over ep, then each slice over dp_shard (how a checkpoint sees the global [E, ...] tensor).
        embed_group: the first and the last rank of this rank's pipeline (Megatron-Core's embedding group: a tied
            embedding's gradient is summed over it); ``None`` without pipelining or on a middle stage's rank.
        replicate_mesh: ``("dp_replicate",)`` mesh of the R replicas of this rank's shard (plain data parallelism's
            ``replicate``, :func:`moetrain.parallel.fsdp.apply_replicate`).
    """

    layout: Layout
    rank: int
    coords: tuple[int, int, int, int]
    device: torch.device
    ep_mesh: ParallelMesh
    dense_mesh: DeviceMesh | None = None
    expert_mesh: DeviceMesh | None = None
    stage_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    pp_ranks: list[int] = field(default_factory=list)
    expert_global_mesh: DeviceMesh | None = None
    embed_group: dist.ProcessGroup | None = None
    replicate_mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        return self.layout.world > 1

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def data_rank(self) -> int:
        """Index of this rank among the data-parallel ranks of its stage (which rows of the batch it reads)."""
        _, r, s, x = self.coords
        return (r * self.layout.dp_shard + s) * self.layout.ep + x

    def stage_sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` summed in place over the data-parallel ranks of this rank's pipeline stage (an all-reduce over
        ``stage_group``, named ``what`` in errors; nothing with one such rank)."""
        if self.layout.data_parallel > 1:
            with named_collective(f"all_reduce ({what}, data-parallel ranks of the stage)", self.stage_group):
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.stage_group)
        return t


def _groups(grid: torch.Tensor, vary: tuple[int, ...], rank: int, timeout: datetime.timedelta
            ) -> tuple[dist.ProcessGroup, list[int]]:
    """Create one group per slice of ``grid`` along the ``vary`` dims (every rank creates every group, in the same
    order, as ``new_group`` requires) and return the one holding ``rank`` with its ranks."""
    fixed = [d for d in range(grid.dim()) if d not in vary]
    moved = grid.permute(*fixed, *vary).reshape(-1, *[grid.shape[d] for d in vary])
    mine: dist.ProcessGroup | None = None
    mine_ranks: list[int] = []
    for block in moved:
        ranks = block.flatten().tolist()
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine, mine_ranks = group, ranks
    assert mine is not None, f"rank {rank} is in no slice of the grid"
    return mine, mine_ranks


def _mesh(groups: list[dist.ProcessGroup], ranks: torch.Tensor, names: tuple[str, ...], device_type: str
          ) -> DeviceMesh:
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)  # one dim per group


def process_groups(layout: Layout) -> int:
    """Process groups one rank of ``layout`` belongs to: the default group and the seven
    :func:`build_layout_mesh` creates holding it (ep, dp_replicate, dp_shard, dp_shard x ep, dp_replicate x dp_shard,
    the stage's, the pipeline's; each even where it has one rank), plus the embedding's first-and-last-stage group
    when ``pp > 2``; 0 for one process (no group)."""
    if layout.world == 1:
        return 0
    return 8 + (layout.pp > 2)


def build_layout_mesh(layout: Layout, timeout_s: float, device: torch.device) -> LayoutMesh:
    """Create the process groups and meshes of ``layout`` over the initialised default group (a collective: every
    rank calls it). For ``layout.world == 1`` no group is created.

    Raises:
        ConfigError: the default group's world size differs from ``layout.world``.
    """
    if layout.world == 1:
        return LayoutMesh(layout, 0, (0, 0, 0, 0), device, single_process(device))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world:
        raise ConfigError(f"parallel: the mesh needs {layout.world} ranks, the job has {world}")
    timeout = datetime.timedelta(seconds=timeout_s)
    grid = layout.grid
    p, r, s, x = (grid == rank).nonzero()[0].tolist()
    with named_collective("new_group (building the pp x dp_replicate x dp_shard x ep mesh)"):
        ep_group, _ = _groups(grid, (3,), rank, timeout)
        rep_group, _ = _groups(grid, (1,), rank, timeout)  # same p, s, x: replicas (both FSDP meshes' first dim)
        shard_group, _ = _groups(grid, (2,), rank, timeout)  # same p, r, x: expert FSDP shards
        shard_ep_group, _ = _groups(grid, (2, 3), rank, timeout)  # same p, r: dense FSDP shards
        edp_group, _ = _groups(grid, (1, 2), rank, timeout)  # same p, x: the replicas of this rank's experts
        stage_group, _ = _groups(grid, (1, 2, 3), rank, timeout)
        pp_group, pp_ranks = _groups(grid, (0,), rank, timeout)
        embed_group = None
        if layout.pp > 2:  # one group per pipeline, created by every rank in the same order
            for ends in grid[[0, -1]].permute(1, 2, 3, 0).reshape(-1, 2).tolist():
                group = dist.new_group(ends, timeout=timeout)
                if rank in ends:
                    embed_group = group
        elif layout.pp == 2:
            embed_group = pp_group
    dtype = device.type
    stage = grid[p]  # [R, S, X]
    if layout.dp_replicate > 1:
        dense = _mesh([rep_group, shard_ep_group], stage.reshape(layout.dp_replicate, -1),
                      ("dp_replicate", "dp_shard_ep"), dtype)
        expert = _mesh([rep_group, shard_group], stage[:, :, x], ("dp_replicate", "dp_shard"), dtype)
    else:
        dense = _mesh([shard_ep_group], stage.flatten(), ("dp_shard_ep",), dtype)
        expert = _mesh([shard_group], stage[0, :, x], ("dp_shard",), dtype)
    # Experts as checkpoints see them: rows split over ep, then each EP slice over dp_shard (dcp.ShardLayout).
    expert_global = _mesh([ep_group, shard_group], grid[p, r].T, ("ep", "dp_shard"), dtype)
    ep_view = _mesh([edp_group, ep_group], stage.reshape(-1, layout.ep), ("dp", "ep"), dtype)
    ep_mesh = ParallelMesh(world_size=world, rank=rank, ep=layout.ep, ep_rank=x,
                           dp=layout.dp_replicate * layout.dp_shard, dp_rank=r * layout.dp_shard + s,
                           device=device, mesh=ep_view, ep_group=ep_group, dp_group=edp_group)
    replicas = _mesh([rep_group], stage[:, s, x], ("dp_replicate",), dtype)
    return LayoutMesh(layout, rank, (p, r, s, x), device, ep_mesh, dense, expert, stage_group, pp_group, pp_ranks,
                      expert_global, embed_group, replicas)


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def nccl_error_handling(backend: str) -> None:
    """Before an NCCL process group is created: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless the environment sets
    it (``os.environ.setdefault``: a user's value wins). With PyTorch's default, 3, NCCL's watchdog tears the
    process down on an error or time-out without a Python error; 2 (CleanUpOnly) aborts the communicator, so the
    error surfaces in the training thread as a ``DistBackendError``, which :func:`.comm.named_collective` turns into
    one line. Sources: https://pytorch.org/docs/stable/torch_nccl_environment_variables.html and
    ``ErrorHandlingMode`` in ``torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp``.
    """
    if backend == "nccl":
        os.environ.setdefault(NCCL_ERROR_HANDLING, "2")


def _store_kwargs(timeout: datetime.timedelta) -> dict[str, Any]:
    """Extra keyword arguments of ``dist.init_process_group``: under torchrun's agent store
    (``TORCHELASTIC_USE_AGENT_STORE=True``, ``--rdzv-backend c10d``), which the agent keeps across the restarts of
    ``--max-restarts``, a client of it with a prefix per restart, ``moetrain/restart_<TORCHELASTIC_RESTART_COUNT>``
    (and the ``rank`` / ``world_size`` an explicit store needs); otherwise none (``env://``). Without the prefix,
    restarted workers find their predecessors' keys (each rank's gloo address) and connect to dead ports: ``Gloo
    connectFullMesh failed ... Connection refused``, seen in torch 2.13 on 2 of 3 restarts."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"moetrain/restart_{torchrun_restart()}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def init_layout_mesh(config: ParallelConfig, device_type: str) -> tuple[LayoutMesh, bool]:
    """Join the job ``torchrun`` started (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``LOCAL_RANK`` in the environment; the default process group is created unless it exists) and build this
    rank's :class:`LayoutMesh` (a collective). The trainer's and ``moetrain serve``'s expert-parallel start.

    Args:
        config: the ``parallel`` section (sizes, ``backend``, ``timeout_s``: the time-out of every collective,
            gloo's and NCCL's watchdog's).
        device_type: ``cpu`` or ``cuda`` (the run's resolved device type); CUDA ranks use ``cuda:LOCAL_RANK``.
    Returns:
        (the mesh, whether this call created the default process group).
    Raises:
        ConfigError: the world size does not fit ``pp * dp_replicate * dp_shard * ep``, or NCCL on a CPU run.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = Layout.from_config(config, world)
    backend = config.backend if config.backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError("parallel.backend: 'nccl' needs train.device=cuda; use 'gloo' (or 'auto') on CPU")
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
        torch.cuda.set_device(device)
    owns = False
    if world > 1 and not dist.is_initialized():
        nccl_error_handling(backend)  # NCCL's watchdog raises in this thread instead of tearing the process down
        with named_collective("init_process_group (rendezvous at MASTER_ADDR:MASTER_PORT)"):
            timeout = datetime.timedelta(seconds=config.timeout_s)  # sub-groups get it in build_layout_mesh
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None,
                                    **_store_kwargs(timeout))
        owns = True
    return build_layout_mesh(layout, config.timeout_s, device), owns
