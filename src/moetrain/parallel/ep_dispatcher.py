"""What the expert-parallel dispatchers (:mod:`.all_to_all`, :mod:`.all_gather`) share: the mesh position, this
rank's experts, the local permuter that groups rows by expert, and the communication counters."""

from __future__ import annotations

import torch

from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.dispatcher import Dispatcher
from moetrain.parallel.comm import CommStats
from moetrain.parallel.layout import ParallelMesh


class EPDispatcher(Dispatcher):
    """Base of the dispatchers that exchange rows over the expert-parallel group.

    Args:
        num_experts: E (global).
        mesh: this rank's :class:`~moetrain.parallel.layout.ParallelMesh` (``ep``, ``ep_rank``, ``ep_group``).
        stats: optional counters of rows and bytes moved, by passes with gradients only (training; the launcher
            resets them when it logs).
        name: label used in error messages (e.g. the layer's module name).
    """

    supports_capacity = True

    def __init__(self, num_experts: int, mesh: ParallelMesh, stats: CommStats | None = None, name: str = "moe"):
        self.num_experts = num_experts
        self.ep, self.ep_rank, self.group = mesh.ep, mesh.ep_rank, mesh.ep_group
        self.local_experts = mesh.local_experts(num_experts)  # this rank's range of global expert ids
        self.permuter = LocalDispatcher(num_experts)
        self.stats = stats
        self.name = name

    def counting(self) -> CommStats | None:
        """The counters to update now: ``stats`` in a pass with gradients (training), else ``None``."""
        return self.stats if torch.is_grad_enabled() else None
