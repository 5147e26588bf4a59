"""The DP x EP device mesh, sized from the ``parallel`` config and the ``torchrun`` environment.

Layout: ``WORLD_SIZE = dp * ep`` ranks in a ``(dp, ep)`` grid, ``rank = dp_rank * ep + ep_rank``, so an EP group
is ``ep`` consecutive ranks (one node's GPUs when ``ep <= nproc_per_node``: token exchange stays on NVLink) and
the ``dp`` groups link the replicas of the same expert shard across EP groups. Every rank reads different data.

Sub-groups are created here with ``new_group(timeout=...)`` and wrapped with ``DeviceMesh.from_group``: a mesh
built by ``init_device_mesh`` gives its sub-groups the backend default time-out (30 min), not the configured one.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from moetrain.errors import ConfigError
from moetrain.parallel import rendezvous
from moetrain.parallel.comm import named_collective
from moetrain.parallel.config import ParallelConfig


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's place in the DP x EP mesh (a single process is the 1 x 1 mesh with no groups).

    Attributes:
        world_size / rank: all ranks, this rank.
        ep / ep_rank: expert-parallel size and this rank's index in its EP group.
        dp / dp_rank: number of EP groups (expert replicas) and this rank's index among them.
        device: the rank's device (``cuda:LOCAL_RANK`` under NCCL).
        mesh: the ``DeviceMesh`` with dims ``("dp", "ep")`` (``None`` for a single process).
        ep_group / dp_group: process groups of this rank's EP group and DP group (``None`` for one process).
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


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def nccl_error_handling(backend: str) -> None:
    """Before an NCCL process group is created: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless the environment sets
    it (``os.environ.setdefault``: a user's value wins).

    NCCL collectives run asynchronously; ProcessGroupNCCL's watchdog thread finds their errors and time-outs (the
    process group's ``timeout``, here ``parallel.timeout_s``). With PyTorch's default, 3, the watchdog tears the
    process down without a Python error, so no rank could print the line naming the collective; 2 (CleanUpOnly)
    aborts the communicator instead, which ends the hung collective and lets the error surface in the training
    thread (``wait()`` or the next collective) as a ``DistBackendError``, which :func:`.comm.named_collective` and
    the engine turn into one line. Sources: https://pytorch.org/docs/stable/torch_nccl_environment_variables.html
    and ``ErrorHandlingMode`` in ``torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp`` (see docs/robustness.md).
    """
    if backend == "nccl":
        os.environ.setdefault(NCCL_ERROR_HANDLING, "2")


def single_process(device: torch.device | str = "cpu") -> ParallelMesh:
    """The trivial 1 x 1 mesh: no process group, every expert local."""
    return ParallelMesh(world_size=1, rank=0, ep=1, ep_rank=0, dp=1, dp_rank=0, device=torch.device(device))


def build_mesh(ep: int, timeout_s: float, device: torch.device | str | None = None) -> ParallelMesh:
    """The DP x EP mesh over an already initialised default process group.

    Args:
        ep: expert-parallel size.
        timeout_s: time-out of the sub-groups' collectives (seconds).
        device: this rank's device; default ``cuda:LOCAL_RANK`` for NCCL, else CPU.
    Raises:
        ConfigError: ``WORLD_SIZE`` is not divisible by ``ep`` (names ``parallel.ep`` and both values).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep < 1 or world % ep:
        raise ConfigError(
            f"parallel.ep: world size {world} (torchrun --nproc_per_node x --nnodes) is not divisible by ep={ep}; "
            f"the data-parallel size dp = world / ep must be a whole number"
        )
    dp = world // ep
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device(f"cuda:{local}") if dist.get_backend() == "nccl" else torch.device("cpu")
    device = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    grid = torch.arange(world).view(dp, ep)  # grid[dp_rank, ep_rank] = global rank
    ep_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    with named_collective("new_group (building the DP x EP mesh)"):
        # Every rank must create every sub-group, in the same order.
        for ranks in grid.tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                ep_group = group
        for ranks in grid.T.tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                dp_group = group
    # Every rank is in exactly one row (its EP group) and one column (its DP group) of the grid.
    assert ep_group is not None and dp_group is not None
    mesh = DeviceMesh.from_group([dp_group, ep_group], device.type, mesh=grid, mesh_dim_names=("dp", "ep"))
    return ParallelMesh(world_size=world, rank=rank, ep=ep, ep_rank=rank % ep, dp=dp, dp_rank=rank // ep,
                        device=device, mesh=mesh, ep_group=ep_group, dp_group=dp_group)


def init_distributed(config: ParallelConfig, device_type: str = "cpu") -> ParallelMesh:
    """Join the job ``torchrun`` started (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``LOCAL_RANK`` in the environment) and build the mesh; without those variables, a single process.

    Args:
        config: the ``parallel`` config section.
        device_type: ``cpu`` or ``cuda`` (the trainer's resolved device type).
    Returns:
        The :class:`ParallelMesh` (single-process when ``WORLD_SIZE`` is unset or 1).
    Raises:
        ConfigError: ``ep > 1`` without ``torchrun``, world size not divisible by ``ep``, or NCCL on a CPU run.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        if config.ep != 1:
            raise ConfigError(
                f"parallel.ep: ep={config.ep} needs {config.ep} processes; launch with "
                f"`torchrun --nproc_per_node {config.ep} -m moetrain train ...`"
            )
        return single_process(device_type)
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError("parallel.backend: 'nccl' needs train.device=cuda; use 'gloo' (or 'auto') on CPU")
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        nccl_error_handling(backend)
        with named_collective("init_process_group (rendezvous at MASTER_ADDR:MASTER_PORT)"):
            # The time-out of every collective (gloo's, and NCCL's watchdog); sub-groups get it in build_mesh.
            timeout = datetime.timedelta(seconds=config.timeout_s)
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None,
                                    **rendezvous.init_kwargs(timeout))
    return build_mesh(config.ep, config.timeout_s, device)
