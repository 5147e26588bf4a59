"""Expert capacity and token dropping.

Legend: T = tokens, E = experts, K = top-k, N = T * K assignments, C = capacity (rows per expert).

An expert accepts at most C of the (token, expert) assignments routed to it; the rest are dropped: a dropped
assignment contributes nothing to its token's output (a token dropped by all its experts leaves the MoE layer as
zeros and continues only through the residual). Padding tokens never take a slot.

Conventions follow Megatron-Core ``moe_utils.get_capacity`` / ``apply_router_token_dropping``:
``C = ceil(T * K / E * capacity_factor)``; policy ``probs`` keeps each expert's C highest gating weights,
``position`` its C earliest tokens (Megatron ranks position with ``torch.topk`` over a 0/1 map, whose tie order is
unspecified: on CPU it keeps arbitrary positions; here ties always go to the earlier token).

Everything stays on device (no host sync): C is a Python int computed from static shapes.
"""

from __future__ import annotations

import math

import torch


def expert_capacity(
    num_tokens: int, top_k: int, num_experts: int, capacity_factor: float, min_capacity: int | None = None
) -> int:
    """``C = ceil(T * K / E * capacity_factor)``, raised to ``min_capacity``, capped at T (an expert can hold at most
    one assignment per token, so C >= T means nothing is dropped).

    Args:
        num_tokens: T of the micro-batch (padding included, so that C is static).
        top_k: K.  num_experts: E.
        capacity_factor: > 0 (1.0 = exactly the balanced load).
        min_capacity: optional lower bound (>= 1).
    Returns:
        C (>= 1 when T >= 1).
    """
    capacity = math.ceil(num_tokens * top_k / num_experts * capacity_factor)
    if min_capacity is not None:
        capacity = max(capacity, min_capacity)
    return min(capacity, num_tokens)


def capacity_keep(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    capacity: int,
    policy: str = "probs",
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which assignments fit in their expert's capacity.

    Every expert ranks the assignments routed to it by priority and keeps the first C: ``probs`` = highest gating
    weight first, ``position`` = earliest token first; ties go to the earlier token. Assignments of padding tokens
    (``valid`` False) are never kept and take no slot. One sort of the N assignments per key, no host sync.

    Args:
        topk_ids: [T, K] int64.
        topk_weights: [T, K] gating weights (the priority of the ``probs`` policy).
        num_experts: E.
        capacity: C.
        policy: ``probs`` or ``position``.
        valid: [T] bool, True for real tokens; ``None``: all real.
    Returns:
        [T, K] bool, True for kept assignments (at most C per expert).
    Raises:
        ValueError: unknown policy.
    """
    t, k = topk_ids.shape
    n = t * k
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1)
    if valid is None:
        real = torch.ones(n, dtype=torch.bool, device=device)
    else:
        real = valid.reshape(-1).to(device=device, dtype=torch.bool).repeat_interleave(k)
    key = torch.where(real, flat_ids, num_experts)  # padding sorts into an extra bucket E
    if policy == "probs":
        # Stable descending sort: equal weights keep flat (token-major) order, i.e. the earlier token first.
        priority = torch.sort(topk_weights.detach().reshape(-1), descending=True, stable=True).indices
    elif policy == "position":
        priority = torch.arange(n, device=device)
    else:
        raise ValueError(f"model.moe.capacity.drop_policy: unknown policy {policy!r}; choose probs or position")
    order = priority[torch.sort(key[priority], stable=True).indices]  # grouped by expert, by priority within
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    start = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted position of each bucket
    rank_sorted = torch.arange(n, device=device) - start[key[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)  # order is a permutation: no collisions
    return ((rank < capacity) & real).reshape(t, k)
