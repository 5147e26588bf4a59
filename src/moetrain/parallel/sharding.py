"""Expert sharding: each EP rank keeps ``E / ep`` consecutive experts of every MoE layer.

Legend: E = experts, E_l = E / ep local experts, F = expert ffn hidden, D = hidden.

The model is built and initialised whole on every rank (same seed, so the same full tensors), then each rank
keeps its slice along the expert dimension: EP=1 and EP=N start from identical weights (DESIGN.md, STYLE.md #6).
The cost is one full model in memory at start-up; a model too large for that should be built on the ``meta``
device and initialised per shard with the same generator offsets (not needed yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetrain.errors import ConfigError
from moetrain.moe.layer import MoELayer
from moetrain.parallel.comm import named_collective
from moetrain.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class ExpertShard:
    """One sharded expert tensor: this rank holds rows ``[offset, offset + local_rows)`` of ``global_rows``
    along dim 0 (the expert dimension)."""

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
    """Replace every routed-expert parameter ``[E, ...]`` by a copy of this rank's slice ``[E_l, ...]``.

    Shared experts (if any) are not routed and stay replicated like every other parameter.

    Args:
        model: a full (unsharded) model.
        mesh: this rank's mesh position (``ep``, ``ep_rank``).
    Returns:
        ``{parameter name: ExpertShard}`` for every sharded parameter (empty when ``ep == 1``: nothing to shard).
    Raises:
        ConfigError: ``ep`` does not divide a layer's expert count.
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
            piece = param.detach()[local.start : local.stop].clone()  # clone: drop the full tensor's storage
            setattr(layer.experts, pname, nn.Parameter(piece, requires_grad=param.requires_grad))
            prefix = f"{layer_name}." if layer_name else ""
            plan[f"{prefix}experts.{pname}"] = ExpertShard(local.start, len(local), num_experts)
    return plan


def gather_full(local: torch.Tensor, shard: ExpertShard, mesh: ParallelMesh) -> torch.Tensor:
    """The full ``[E, ...]`` tensor from every EP rank's ``[E_l, ...]`` slice (an all-gather over the EP group;
    for checks and exports, not the training path)."""
    if mesh.ep == 1:
        return local.detach().clone()
    pieces = [torch.empty_like(local) for _ in range(mesh.ep)]
    with named_collective("all_gather (expert weights)", mesh.ep_group):
        dist.all_gather(pieces, local.detach().contiguous(), group=mesh.ep_group)
    return torch.cat(pieces, dim=0)
