"""The MoE layer: route -> dispatch -> experts -> combine; returns its output and an explicit aux record.

Legend: B = batch, S = sequence, T = B * S tokens, D = hidden, E = experts, K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.moe.config import MoEConfig
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.experts import SwiGLUExperts
from moetrain.moe.losses import expert_counts, router_z_loss, switch_load_balancing_loss
from moetrain.moe.router import TopKRouter


@dataclass(frozen=True)
class MoEAux:
    """What one MoE layer reports for one forward pass (no module state, no globals).

    Attributes:
        aux_loss: scalar fp32 Switch load-balancing loss (balanced = 1.0), unweighted.
        z_loss: scalar fp32 router z-loss, unweighted.
        tokens_per_expert: [E] fp32 assignments per expert over real tokens (detached).
        router_logits: [T, E] fp32 (for pooled losses and statistics).
    """

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    router_logits: torch.Tensor


class MoELayer(nn.Module):
    """Dropless top-k MoE FFN (Mixtral-style) with SwiGLU experts.

    Args:
        hidden: D.
        config: the layer's :class:`MoEConfig`.
    """

    def __init__(self, hidden: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = TopKRouter(hidden, config.num_experts, config.top_k, config.norm_topk_prob)
        self.experts = SwiGLUExperts(config.num_experts, hidden, config.expert_ffn_hidden, config.backend)
        self.dispatcher = LocalDispatcher(config.num_experts)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEAux]:
        """Args:
            x: [B, S, D] (or [T, D]).
            padding_mask: [B, S] (or [T]) True for real tokens; padding is still routed and computed (its output
                is discarded by the loss) but excluded from the aux losses and counts.
        Returns:
            (y with the shape and dtype of x, :class:`MoEAux`).
        """
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, D]
        routing = self.router(tokens)
        x_perm, tokens_per_expert, meta = self.dispatcher.dispatch(tokens, routing.topk_ids, routing.topk_weights)
        y_perm = self.experts(x_perm, tokens_per_expert)  # [N, D]
        y = self.dispatcher.combine(y_perm, meta).to(x.dtype)
        aux = MoEAux(
            aux_loss=switch_load_balancing_loss(routing.probs, routing.topk_ids, padding_mask),
            z_loss=router_z_loss(routing.logits, padding_mask),
            tokens_per_expert=expert_counts(routing.topk_ids, self.config.num_experts, padding_mask).detach(),
            router_logits=routing.logits,
        )
        return y.reshape(shape), aux
