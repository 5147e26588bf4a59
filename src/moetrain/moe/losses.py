"""Router losses: load balancing (Switch, pooled over layers, sequence-level, global-batch), z-loss and the
expert-utilisation regulariser; every one excludes padding tokens and returns an unweighted fp32 scalar.

Legend: L = MoE layers, B = sequences, S = sequence length, T = tokens, E = experts, K = top-k.

Notation shared by the load-balancing losses: ``c_i`` = assignments of real tokens to expert i (from the top-k
selection, before any capacity dropping; non-differentiable), ``n`` = real tokens, ``f_i = c_i / (K n)`` (sums to
1), ``P_i`` = mean over real tokens of the routing probability of expert i (``Routing.probs``: softmax, or
normalised sigmoid; differentiable). Every loss takes probabilities that were computed once from the logits: none
applies a softmax of its own.

Conventions: "balanced = 1" (Switch / Megatron-Core / DeepSeek: perfectly balanced routing gives 1.0 for any K)
except :func:`pooled_load_balancing_loss`, which follows transformers' "balanced = K".
"""

from __future__ import annotations

import torch


def _valid(mask: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    """[T] fp32 weights: 1 for real tokens, 0 for padding.

    Raises:
        ValueError: the mask does not hold one entry per token (e.g. past + new tokens during cached generation).
    """
    if mask is None:
        return torch.ones(num_tokens, device=device)
    if mask.numel() != num_tokens:
        raise ValueError(f"padding_mask: shape {tuple(mask.shape)} holds {mask.numel()} entries for {num_tokens} "
                         f"tokens (one per token)")
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


def assignment_counts(topk_ids: torch.Tensor, num_experts: int, mask: torch.Tensor) -> torch.Tensor:
    """Per-expert sum of a per-assignment 0/1 mask.

    Args:
        topk_ids: [T, K] int64.
        num_experts: E.
        mask: [T, K] bool or 0/1, which assignments to count.
    Returns:
        [E] fp32 (a ``scatter_add``, no host sync; exact up to 2**24 per call).
    """
    counts = torch.zeros(num_experts, device=topk_ids.device)
    return counts.scatter_add_(0, topk_ids.reshape(-1), mask.reshape(-1).to(counts.dtype))


def expert_counts(topk_ids: torch.Tensor, num_experts: int, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Assignments per expert, padding excluded.

    Args:
        topk_ids: [T, K] int64.
        num_experts: E.
        padding_mask: [T] (or any shape with T elements) bool/0-1, True for real tokens; ``None``: all real.
    Returns:
        [E] fp32 counts.
    """
    t, k = topk_ids.shape
    valid = _valid(padding_mask, t, topk_ids.device)
    return assignment_counts(topk_ids, num_experts, valid[:, None].expand(t, k))


def switch_load_balancing_loss(
    probs: torch.Tensor, topk_ids: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss of one layer, "balanced = 1.0" for any K.

    ``loss = E * sum_i f_i * P_i`` (Fedus et al., 2021, eq. 4-6, generalised to top-k by counting every
    assignment; equals Megatron-Core ``switch_load_balancing_loss_func`` with ``moe_aux_loss_coeff=1``).
    transformers' ``load_balancing_loss_func`` lets ``f`` sum to K, so its value is K times this one.
    Gradient flows through ``P`` only.

    Args:
        probs: [T, E] routing probabilities (``Routing.probs``, never re-softmaxed here).
        topk_ids: [T, K] int64 selection (before dropping).
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


def pooled_load_balancing_loss(
    counts: torch.Tensor, prob_sums: torch.Tensor, num_tokens: torch.Tensor
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the Switch statistics
    pooled over all layers before the product, "balanced = K".

    ``loss = E * sum_i (sum_l c_li / sum_l n_l) * (sum_l S_li / sum_l n_l)`` where ``S_li`` is the sum over real
    tokens of layer l of expert i's probability. (transformers recomputes the top-k from the logits; for softmax
    routing without an expert bias or groups that is our selection.)

    Args:
        counts: [L, E] per-layer assignment counts of real tokens (selection before dropping).
        prob_sums: [L, E] per-layer sums of ``Routing.probs`` over real tokens (differentiable).
        num_tokens: [L] real tokens per layer.
    Returns:
        scalar fp32.
    """
    e = counts.shape[-1]
    rows = num_tokens.float().sum().clamp(min=1.0)
    return e * torch.sum((counts.sum(dim=0) / rows) * (prob_sums.sum(dim=0) / rows))


def sequence_load_balancing_loss(
    probs: torch.Tensor, topk_ids: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Sequence-level balance loss of DeepSeek-V2 (sec. 2.2.2) / DeepSeek-V3 (eq. 17-20), "balanced = 1.0".

    The Switch loss computed within each sequence (``f`` and ``P`` over that sequence's real tokens, counts from the
    top-k selection before any dropping), then averaged over the sequences that hold at least one real token
    (Megatron-Core ``seq_aux_loss``). With sigmoid scores ``probs`` is DeepSeek-V3's normalised ``s'``.

    Args:
        probs: [B, S, E] routing probabilities.
        topk_ids: [B, S, K] int64.
        padding_mask: [B, S] True for real tokens, or ``None``.
    Returns:
        scalar fp32.
    """
    b, s, e = probs.shape
    k = topk_ids.shape[-1]
    valid = _valid(padding_mask, b * s, probs.device).reshape(b, s)
    n = valid.sum(dim=1)  # [B]
    counts = torch.zeros(b, e, device=probs.device)
    counts.scatter_add_(1, topk_ids.reshape(b, s * k), valid.repeat_interleave(k, dim=1))  # [B, E]
    f = counts / (n.clamp(min=1.0)[:, None] * k)
    p = (probs * valid[..., None]).sum(dim=1) / n.clamp(min=1.0)[:, None]  # [B, E]
    per_seq = e * (f * p).sum(dim=1)  # [B]
    has_tokens = (n > 0).float()
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def global_load_balancing_loss(
    prob_sum: torch.Tensor, num_tokens: torch.Tensor, global_counts: torch.Tensor
) -> torch.Tensor:
    """Global-batch load-balancing loss (Qiu et al., 2025, "Demons in the Detail"; Megatron-Core
    ``global_aux_loss``), "balanced = 1.0".

    ``loss = E * sum_i f_i^G * P_i`` with ``f^G`` from the counts of the whole optimizer step (all micro-batches,
    all data-parallel ranks; non-differentiable) and ``P`` from this micro-batch. Averaging it over equally sized
    micro-batches (and ranks) gives exactly the loss of one large batch, so gradient accumulation is exact.

    Args:
        prob_sum: [E] sum over this micro-batch's real tokens of ``Routing.probs`` (differentiable).
        num_tokens: scalar, this micro-batch's real tokens.
        global_counts: [E] the step's assignment counts (sums to K * global real tokens).
    Returns:
        scalar fp32.
    """
    e = prob_sum.shape[-1]
    f = global_counts.float() / global_counts.float().sum().clamp(min=1.0)
    p = prob_sum / num_tokens.float().clamp(min=1.0)
    return e * torch.sum(f * p)


def router_z_loss(logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss: mean over real tokens of ``logsumexp(logits)**2`` (ST-MoE, Zoph et al., 2022, eq. 5;
    Megatron-Core ``z_loss_func`` with coefficient 1, whose padding mask is inverted: True = padding).

    Args:
        logits: [T, E] fp32 router logits.
        padding_mask: [T] True for real tokens, or ``None``.
    Returns:
        scalar fp32.
    """
    valid = _valid(padding_mask, logits.shape[0], logits.device)
    z = torch.logsumexp(logits.float(), dim=-1)  # [T]
    return (z.square() * valid).sum() / valid.sum().clamp(min=1.0)


def utilization_loss(probs: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Expert-utilisation regulariser: the standard deviation over experts (population, divisor E) of ``P_i``, the
    mean routing probability of expert i over real tokens; 0 when every expert gets the same mean probability.

    A soft-importance balance term in the spirit of Shazeer et al. (2017, eq. 6-7), whose importance loss is the
    squared coefficient of variation of ``sum_t p_ti``; as ``P`` sums to 1, ``CV = E * std(P)`` and this loss is
    ``CV / E`` (unsquared, so its gradient does not vanish near balance).

    Args:
        probs: [T, E] routing probabilities.
        padding_mask: [T] True for real tokens, or ``None``.
    Returns:
        scalar fp32.
    """
    valid = _valid(padding_mask, probs.shape[0], probs.device)
    p = (probs * valid[:, None]).sum(dim=0) / valid.sum().clamp(min=1.0)  # [E]
    var = (p - p.mean()).square().mean()
    # sqrt has an infinite slope at 0: exact balance (e.g. a zero-initialised router) must give a zero gradient.
    positive = var > 0
    return torch.where(positive, torch.where(positive, var, 1.0).sqrt(), 0.0)
