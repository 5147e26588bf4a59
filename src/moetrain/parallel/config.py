"""Configuration of expert/data parallelism (the ``parallel`` section of the run config).

No process groups or devices live here (they come from the ``torchrun`` environment at launch): the data-parallel
size is derived, ``dp = WORLD_SIZE // ep``, and checked in :func:`moetrain.parallel.mesh.init_distributed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.configlib import require


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Expert parallelism (EP) carved out of data parallelism (DP), as in torchtitan / Megatron-Core.

    Every rank reads a different slice of the global batch (``train.batch_size`` sequences per micro-batch are
    split over all ``WORLD_SIZE`` ranks); the ranks form a ``dp x ep`` mesh; each EP group of ``ep`` ranks shares
    the ``E`` experts of every MoE layer (``E / ep`` each) and exchanges tokens with the dispatcher; the ``dp``
    EP groups are replicas of each other.

    Fields:
        ep: expert-parallel size (ranks per EP group); must divide ``model.moe.num_experts`` and ``WORLD_SIZE``.
        dispatcher: ``all_to_all`` (each token travels only to the ranks holding its experts; uneven splits) or
            ``all_gather`` (every rank gathers all tokens of its EP group, computes its experts on them, and a
            reduce-scatter returns the partial outputs; simpler, ``ep`` times more traffic).
        timeout_s: seconds a collective may wait for a peer before every rank fails with an error naming the
            collective (``init_process_group(timeout=...)``; honoured by gloo and, with async error handling, by
            NCCL).
        backend: ``auto`` (NCCL on CUDA, gloo on CPU), ``gloo`` or ``nccl``.
    """

    ep: int = 1
    dispatcher: Literal["all_to_all", "all_gather"] = "all_to_all"
    timeout_s: float = 600.0
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    def __post_init__(self) -> None:
        require(self.ep >= 1, "ep", f"must be >= 1, got {self.ep}")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
