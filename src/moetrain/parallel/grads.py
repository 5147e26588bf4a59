"""Gradient synchronisation and clipping under DP x EP, equal to one process on the global batch.

Each rank's loss is the mean over its own tokens and every rank has as many tokens, so the global-batch loss is
the mean of the W rank losses and every gradient must be divided by W (= world size):

- a non-expert parameter is replicated on all W ranks, each holding the gradient of its own loss: all-reduce SUM
  over all ranks, / W (what DDP does);
- a routed-expert shard already holds, after the all-to-all backward, the gradient contributions of every rank of
  its EP group (their tokens came to it); the same shard is replicated on the ``dp`` ranks of its DP group (one
  per EP group): all-reduce SUM over the DP group, / W. With ``ep == 1`` there are no shards and experts are
  ordinary replicated parameters.

Explicit bucketed all-reduces rather than DDP: the two groups of parameters need different process groups, the
model's forward returns a dataclass, and every rank must issue exactly the same collectives in the same order
(a parameter without a gradient on one rank contributes zeros rather than being skipped).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moetrain.parallel.comm import named_collective
from moetrain.parallel.mesh import ParallelMesh


def _params(model: nn.Module, expert_names: set[str]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(non-expert, expert) trainable parameters, in ``named_parameters`` order (the same on every rank)."""
    dense: list[nn.Parameter] = []
    experts: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (experts if name in expert_names else dense).append(p)
    return dense, experts


def _all_reduce_sum(params: list[nn.Parameter], group: dist.ProcessGroup | None, scale: float, name: str) -> None:
    """``p.grad = scale * sum over group of p.grad`` for ``params``, one flat buffer per dtype; a missing
    gradient counts as zeros (and is materialised, so every replica steps the parameter)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}  # the gradients, in ``params`` order
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        grads = by_dtype[dtype]
        flat: torch.Tensor = _flatten_dense_tensors(grads)  # type: ignore[no-untyped-call]  # torch._utils: untyped
        if dist.get_world_size(group) > 1:
            with named_collective(f"all_reduce ({name})", group):
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.mul_(scale)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):  # type: ignore[no-untyped-call]
            g.copy_(synced)


def sync_gradients(model: nn.Module, mesh: ParallelMesh, expert_names: set[str]) -> None:
    """Turn each rank's local gradients into the global-batch gradients (see the module docstring).

    Args:
        model: the rank's (sharded) model after ``backward``.
        mesh: this rank's mesh position.
        expert_names: names of the sharded expert parameters (keys of
            :func:`moetrain.parallel.sharding.shard_experts`'s plan).
    Raises:
        CollectiveError: a peer failed during the all-reduce.
    """
    if not mesh.distributed:
        return
    dense, experts = _params(model, expert_names)
    scale = 1.0 / mesh.world_size
    _all_reduce_sum(dense, dist.group.WORLD, scale, "gradients of non-expert parameters, all ranks")
    _all_reduce_sum(experts, mesh.dp_group, scale, "gradients of expert shards, DP group")


def clip_grad_norm(model: nn.Module, mesh: ParallelMesh, expert_names: set[str], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (all parameters, every expert shard counted once) to ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model would (coefficient ``max_norm / (norm + 1e-6)``,
    at most 1). Call after :func:`sync_gradients`.

    Returns:
        The fp32 norm before clipping (scalar tensor, identical on every rank).
    Raises:
        CollectiveError: a peer failed during the all-reduce of the expert shards' squared norm.
    """
    dense, experts = _params(model, expert_names)
    device = next(model.parameters()).device
    dense_sq = sum((p.grad.float().square().sum() for p in dense if p.grad is not None),
                   torch.zeros((), device=device))
    expert_sq = sum((p.grad.float().square().sum() for p in experts if p.grad is not None),
                    torch.zeros((), device=device))
    if mesh.distributed and mesh.ep > 1:
        with named_collective("all_reduce (squared gradient norm of expert shards, EP group)", mesh.ep_group):
            dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=mesh.ep_group)
    norm = (dense_sq + expert_sq).sqrt()
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in dense + experts:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def all_reduce_mean(value: torch.Tensor, mesh: ParallelMesh, name: str) -> torch.Tensor:
    """Mean of a scalar (or small tensor) over all ranks (a copy; identity for one process)."""
    if not mesh.distributed:
        return value.clone()
    out = value.detach().clone()
    with named_collective(f"all_reduce ({name})"):
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / mesh.world_size
