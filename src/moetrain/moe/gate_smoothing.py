"""Gate-output smoothing: a penalty on the entropy deficit of each token's routing distribution
(``model.moe.losses.entropy_loss_coeff``; motivation and measured effect: docs/data.md).

Legend: T = tokens, E = experts.

Per MoE layer, over the real tokens t (padding excluded)::

    p_t      = the token's routing distribution over the E experts (softmax probabilities, or sigmoid scores
               normalised to sum 1)
    H(p_t)   = -sum_e p_te log p_te                      (nats; 0 for one-hot, log E for uniform)
    loss     = mean_t (log E - H(p_t)) / log E           (in [0, 1]: 0 = uniform gates, 1 = one-hot gates)

Sources: the confidence penalty of Pereyra et al., 2017 (arXiv:1701.06548), applied to the gate, against the routing
fluctuation of StableMoE (Dai et al., 2022, arXiv:2204.08396). A mean over tokens, so token-weighted gradient
accumulation (train/microbatch_weights.py) is exactly one large batch for it.
"""

from __future__ import annotations

import math

import torch


def routing_entropy_deficit(probs: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The gate-output smoothing loss of one MoE layer (see the module docstring).

    Args:
        probs: [T, E] routing probabilities (rows need not sum to 1: sigmoid scores are normalised here).
        padding_mask: [T] (or any shape with T elements) True for real tokens; ``None``: all real.
    Returns:
        scalar fp32 in [0, 1]; 0 for E = 1 or no real token.
    """
    t, e = probs.shape
    if e < 2:
        return probs.new_zeros((), dtype=torch.float32)
    p = probs.float()
    p = p / p.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    entropy = -(p * torch.log(p.clamp(min=1e-20))).sum(dim=-1)  # [T] nats; 0 * log 0 counts as 0
    deficit = 1.0 - entropy / math.log(e)  # [T]
    if padding_mask is None:
        return deficit.mean()
    valid = padding_mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
    return (deficit * valid).sum() / valid.sum().clamp(min=1.0)
