"""Top-k router: logits -> scores -> top-k expert ids and gating weights.

Legend: T = tokens, D = hidden, E = experts, K = top-k.

The router runs in fp32 even under bf16 autocast: its logits are small differences between experts (a bf16
mantissa of 8 bits flips near-ties, e.g. logits 1.001 vs 1.003) and the softmax, the top-k choice and the
load-balancing loss are sensitive to them (Switch Transformer, sec. 2.4 "selective precision"). The cost is one
fp32 [T, D] x [D, E] GEMM, negligible next to the experts.

Tie-breaking is deterministic: among equal scores the lowest expert index wins (a stable descending sort), so
results do not depend on the backend's ``topk`` implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens.

    Attributes:
        logits: [T, E] fp32 router logits ``x @ W^T``.
        probs: [T, E] fp32 softmax of the logits over all experts.
        topk_ids: [T, K] int64 chosen experts, best first (ties: lowest index first).
        topk_weights: [T, K] fp32 gating weights (the top-k probabilities, renormalised when configured).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def topk_stable(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with ties broken by the lowest index.

    Args:
        scores: [..., E] float.
        k: how many to keep (<= E).
    Returns:
        (values [..., K], indices [..., K] int64), best first.
    """
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def softmax_topk(logits: torch.Tensor, k: int, norm_topk_prob: bool) -> Routing:
    """Softmax over all experts, then top-k (Mixtral; Qwen3-MoE with ``norm_topk_prob``).

    Matches ``transformers`` ``MixtralTopKRouter`` / ``Qwen3MoeSparseMoeBlock`` routing.

    Args:
        logits: [T, E] router logits (cast to fp32 here).
        k: experts per token.
        norm_topk_prob: divide the top-k probabilities by their sum.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    weights, ids = topk_stable(probs, k)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits=logits, probs=probs, topk_ids=ids, topk_weights=weights)


class TopKRouter(nn.Module):
    """Linear gate ``W`` [E, D] (no bias) followed by softmax top-k; computed in fp32 (see module docstring)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> Routing:
        """x: [T, D] any float dtype -> :class:`Routing` (fp32)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        return softmax_topk(logits, self.top_k, self.norm_topk_prob)
