"""The ``pp x dp_replicate x dp_shard x ep`` device mesh of the FSDP2 engine, from the ``parallel`` config and the
``torchrun`` environment.

Legend: P = pp (pipeline stages), R = dp_replicate (HSDP replicas), S = dp_shard (FSDP shards), X = ep (expert
parallel), W = P * R * S * X = WORLD_SIZE.

Ranks fill a ``(P, R, S, X)`` grid, ``rank = ((p * R + r) * S + s) * X + x``: an EP group is X consecutive ranks
(one node's GPUs when X <= nproc_per_node), pipeline stages are the outermost dimension (as in torchtitan). EP is
borrowed from data parallelism: all ``R * S * X`` ranks of a stage read different rows of the global batch, so for
the non-expert parameters they are all data-parallel ranks (FSDP2 shards them over the ``S * X`` ranks of a
replica and replicates over R); an expert shard (E / X experts) is replicated by the ``R * S`` ranks with the same
``x``, over which FSDP2 shards it (over S) and replicates it (over R).

Every process group is created with ``new_group(timeout=parallel.timeout_s)`` and wrapped by
``DeviceMesh.from_group`` (as :mod:`moetrain.parallel.mesh` does): ``init_device_mesh`` would give sub-groups the
backend default time-out.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moetrain.errors import ConfigError
from moetrain.parallel.comm import named_collective
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import ParallelMesh

DIMS = ("pp", "dp_replicate", "dp_shard", "ep")


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
            raise ConfigError(
                f"parallel: world size {world} (torchrun --nproc_per_node x --nnodes) is not pp * dp_replicate * "
                f"dp_shard * ep = {config.pp} * {config.dp_replicate or '(the rest)'} * {config.dp_shard} * "
                f"{config.ep}; change parallel.pp / dp_shard / ep / dp_replicate or the number of processes")
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

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(p, r, s, x) of ``rank``."""
        x = rank % self.ep
        s = rank // self.ep % self.dp_shard
        r = rank // (self.ep * self.dp_shard) % self.dp_replicate
        return rank // (self.ep * self.dp_shard * self.dp_replicate), r, s, x

    def describe(self) -> str:
        """One line: the sizes and what each dimension shards."""
        return (f"mesh pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x ep {self.ep} "
                f"= {self.world} ranks; non-expert parameters sharded over {self.dp_shard * self.ep} ranks "
                f"(dp_shard x ep), expert shards over {self.dp_shard} (dp_shard), replicated x{self.dp_replicate}; "
                f"{self.data_parallel} data-parallel ranks per stage")


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
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh=ranks.flatten(), mesh_dim_names=names)
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)


def build_layout_mesh(layout: Layout, timeout_s: float, device: torch.device) -> LayoutMesh:
    """Create the process groups and meshes of ``layout`` over the initialised default group (a collective: every
    rank calls it). For ``layout.world == 1`` no group is created.

    Raises:
        ConfigError: the default group's world size differs from ``layout.world``.
    """
    if layout.world == 1:
        return LayoutMesh(layout, 0, (0, 0, 0, 0), device,
                          ParallelMesh(world_size=1, rank=0, ep=1, ep_rank=0, dp=1, dp_rank=0, device=device))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world:
        raise ConfigError(f"parallel: the mesh needs {layout.world} ranks, the job has {world}")
    timeout = datetime.timedelta(seconds=timeout_s)
    grid = layout.grid
    p, r, s, x = layout.coords(rank)
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
    # Experts as checkpoints see them: rows split over ep, then each EP slice over dp_shard (moetrain.parallel.engine).
    expert_global = _mesh([ep_group, shard_group], grid[p, r].T, ("ep", "dp_shard"), dtype)
    ep_mesh = ParallelMesh(world_size=world, rank=rank, ep=layout.ep, ep_rank=x,
                           dp=layout.dp_replicate * layout.dp_shard, dp_rank=r * layout.dp_shard + s,
                           device=device, mesh=dense, ep_group=ep_group, dp_group=edp_group)
    replicas = _mesh([rep_group], stage[:, s, x], ("dp_replicate",), dtype)
    return LayoutMesh(layout, rank, (p, r, s, x), device, ep_mesh, dense, expert, stage_group, pp_group, pp_ranks,
                      expert_global, embed_group, replicas)

