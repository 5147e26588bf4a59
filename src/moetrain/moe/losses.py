"""Router losses: Switch load balancing and z-loss, both excluding padding tokens.

Legend: T = tokens, E = experts, K = top-k.
"""

from __future__ import annotations

import torch


def _valid(mask: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    """[T] fp32 weights: 1 for real tokens, 0 for padding."""
    if mask is None:
        return torch.ones(num_tokens, device=device)
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


def expert_counts(topk_ids: torch.Tensor, num_experts: int, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Assignments per expert, padding excluded.

    Args:
        topk_ids: [T, K] int64.
        num_experts: E.
        padding_mask: [T] (or any shape with T elements) bool/0-1, True for real tokens; ``None``: all real.
    Returns:
        [E] fp32 counts (fp32 so the count is a ``scatter_add`` with no host sync; exact up to 2**24).
    """
    t, k = topk_ids.shape
    valid = _valid(padding_mask, t, topk_ids.device)
    counts = torch.zeros(num_experts, device=topk_ids.device)
    return counts.scatter_add_(0, topk_ids.reshape(-1), valid.repeat_interleave(k))


def switch_load_balancing_loss(
    probs: torch.Tensor, topk_ids: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, normalised so perfectly balanced routing gives exactly 1.0 for any K.

    ``loss = E * sum_i f_i * P_i`` with ``f_i`` = share of the T*K assignments that go to expert i (sums to 1) and
    ``P_i`` = mean router probability of expert i, both over real tokens only (Fedus et al., 2021, eq. 4-6;
    Megatron-Core ``switch_load_balancing_loss_func`` up to its K factor). transformers' ``load_balancing_loss_func``
    counts ``f_i`` per token (sums to K), so its value is K times this one.

    Gradient flows through ``P`` only (``f`` comes from a discrete choice).

    Args:
        probs: [T, E] fp32 softmax probabilities (the same tensor the top-k was taken from; never re-softmaxed).
        topk_ids: [T, K] int64.
        padding_mask: [T] True for real tokens, or ``None``.
    Returns:
        scalar fp32.
    """
    t, e = probs.shape
    k = topk_ids.shape[1]
    valid = _valid(padding_mask, t, probs.device)
    n_valid = valid.sum().clamp(min=1.0)
    f = expert_counts(topk_ids, e, padding_mask) / (n_valid * k)  # [E], sums to 1
    p = (probs * valid[:, None]).sum(dim=0) / n_valid  # [E]
    return e * torch.sum(f * p)


def router_z_loss(logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss: mean over real tokens of ``logsumexp(logits)**2`` (ST-MoE, Zoph et al., 2022, eq. 5;
    Megatron-Core ``z_loss_func``).

    Args:
        logits: [T, E] fp32 router logits.
        padding_mask: [T] True for real tokens, or ``None``.
    Returns:
        scalar fp32.
    """
    valid = _valid(padding_mask, logits.shape[0], logits.device)
    z = torch.logsumexp(logits.float(), dim=-1)  # [T]
    return (z.square() * valid).sum() / valid.sum().clamp(min=1.0)
