"""The MoE layer: route -> capacity -> dispatch -> experts -> combine (+ shared expert); returns its output and an
explicit record of losses and counts.

Legend: B = batch, S = sequence, T = B * S tokens, D = hidden, E = experts, K = top-k, C = capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.errors import ConfigError
from moetrain.moe.capacity import capacity_keep, expert_capacity
from moetrain.moe.config import MoEConfig
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.experts import RoutedExperts
from moetrain.moe.fast_moe import fused_moe
from moetrain.moe.losses import (
    _valid,
    assignment_counts,
    expert_counts,
    router_z_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    utilization_loss,
)
from moetrain.moe.router import Routing, TopKRouter
from moetrain.moe.shared_expert import SharedExpert


@dataclass(frozen=True)
class MoEAux:
    """What one MoE layer reports for one forward pass (no module state, no globals). Losses are unweighted
    (the coefficients are applied by the model); counts cover real tokens only.

    Attributes:
        aux_loss: scalar fp32 Switch load-balancing loss of this layer (balanced = 1.0;
            :func:`~moetrain.moe.losses.switch_load_balancing_loss`).
        z_loss: scalar fp32 router z-loss (:func:`~moetrain.moe.losses.router_z_loss`).
        seq_aux_loss: scalar fp32 sequence-level balance loss, mean over the B sequences (balanced = 1.0).
        util_loss: scalar fp32 standard deviation of the experts' mean routing probability.
        tokens_per_expert: [E] fp32 assignments per expert chosen by the router, before dropping (detached).
        dropped_per_expert: [E] fp32 of those assignments dropped by the capacity limit (zeros when dropless).
        prob_sum: [E] fp32 sum over real tokens of the routing probabilities (differentiable; the pooled and
            global-batch losses are built from it by the model).
        num_tokens: scalar fp32 real tokens.
        router_logits: [T, E] fp32 (for statistics and external losses).
        capacity: C in force, or ``None`` when dropless.
    """

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    seq_aux_loss: torch.Tensor
    util_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped_per_expert: torch.Tensor
    prob_sum: torch.Tensor
    num_tokens: torch.Tensor
    router_logits: torch.Tensor
    capacity: int | None = None


class MoELayer(nn.Module):
    """Top-k MoE FFN: router (softmax or sigmoid, groups, expert bias), optional capacity, routed experts
    (SwiGLU or GELU; grouped_mm, padded or loop backend), optional (gated) shared expert.

    Parameter names follow transformers where they exist: ``router.weight`` [E, D] (HF ``gate.weight``),
    ``router.e_score_correction_bias`` [E], ``experts.gate_up_proj`` / ``experts.up_proj`` and
    ``experts.down_proj``, ``shared_expert.{gate,up,down}_proj.weight`` and ``shared_expert_gate.weight`` [1, D].

    Args:
        hidden: D.
        config: the layer's :class:`MoEConfig`.
    """

    def __init__(self, hidden: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = TopKRouter(hidden, config)
        self.experts = RoutedExperts(config.num_experts, hidden, config.expert_ffn_hidden,
                                     config.expert_activation, config.backend)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_ffn_hidden > 0:
            self.shared_expert = SharedExpert(hidden, config.shared_expert_ffn_hidden, config.expert_activation)
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.dispatcher = LocalDispatcher(config.num_experts)

    def set_dispatcher(self, dispatcher) -> None:
        """Attach a token dispatcher from outside (expert parallelism: ``moetrain.parallel``), keeping model code
        single-device. It must implement ``dispatch`` / ``combine`` like :class:`LocalDispatcher`, and
        ``self.experts`` must then hold exactly the experts it routes rows to (``moetrain.parallel.sharding``)."""
        self.dispatcher = dispatcher

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEAux]:
        """Args:
            x: [B, S, D] (or [T, D], one sequence).
            padding_mask: [B, S] (or [T]) True for real tokens. Dropless, padding is still routed and computed
                (its output is discarded by the loss); with a capacity it is dropped and takes no slot. Padding
                never counts in the losses or counts.
        Returns:
            (y with the shape and dtype of x, :class:`MoEAux`).
        Raises:
            ConfigError: capacity or the padded backend with a dispatcher that only supports dropless dispatch.
        """
        c = self.config
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, D]
        t = tokens.shape[0]
        valid = None if padding_mask is None else padding_mask.reshape(-1).to(device=x.device, dtype=torch.bool)
        routing = self.router(tokens)

        keep, capacity, layout = None, None, None
        factor = c.capacity_factor_for(self.training)
        if factor is not None:
            capacity = expert_capacity(t, c.top_k, c.num_experts, factor, c.min_capacity)
            keep = capacity_keep(routing.topk_ids, routing.topk_weights, c.num_experts, capacity, c.drop_policy, valid)
            if c.pad_to_capacity or c.backend == "padded":
                layout = capacity
        elif c.backend == "padded":
            # Dropless capacity buffers must fit the busiest expert: one host sync (the price of this backend).
            layout = max(int(expert_counts(routing.topk_ids, c.num_experts).max()), 1)

        fused = keep is None and layout is None and c.backend == "fused" and type(self.dispatcher) is LocalDispatcher
        if fused:  # dropless on one device: dispatch, experts and combine as one Function (moe/fast_moe.py)
            y = fused_moe(tokens, routing.topk_ids, routing.topk_weights, self.experts.w_in, self.experts.down_proj,
                          self.experts.activation, recompute=c.recompute_experts).to(x.dtype)
        elif keep is None and layout is None:
            x_rows, tokens_per_expert, meta = self.dispatcher.dispatch(tokens, routing.topk_ids, routing.topk_weights)
        else:
            if not getattr(self.dispatcher, "supports_capacity", False):
                raise ConfigError(
                    f"model.moe: capacity_factor={c.capacity_factor} / backend={c.backend!r} need a dispatcher "
                    f"that drops and pads; {type(self.dispatcher).__name__} is dropless only")
            x_rows, tokens_per_expert, meta = self.dispatcher.dispatch(
                tokens, routing.topk_ids, routing.topk_weights, keep=keep, capacity=layout)
        if not fused:
            if c.recompute_experts and torch.is_grad_enabled():
                expert_out = checkpoint(self.experts, x_rows, tokens_per_expert, use_reentrant=False)
            else:
                expert_out = self.experts(x_rows, tokens_per_expert)
            y = self.dispatcher.combine(expert_out, meta).to(x.dtype)  # [T, D]

        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            y = y + shared.to(y.dtype)
        return y.reshape(shape), self._record(routing, shape, padding_mask, keep, capacity)

    def _record(self, routing: Routing, shape: torch.Size, padding_mask: torch.Tensor | None,
                keep: torch.Tensor | None, capacity: int | None) -> MoEAux:
        """The layer's losses and counts (all over real tokens)."""
        e = self.config.num_experts
        ids, probs = routing.topk_ids, routing.probs
        t = ids.shape[0]
        valid = _valid(padding_mask, t, probs.device)  # [T] fp32
        counts = expert_counts(ids, e, padding_mask)
        if keep is None:
            dropped = torch.zeros_like(counts)
        else:
            dropped = assignment_counts(ids, e, (~keep) & (valid[:, None] > 0))
        b, s = (shape[0], shape[1]) if len(shape) == 3 else (1, t)
        seq_mask = None if padding_mask is None else padding_mask.reshape(b, s)
        return MoEAux(
            aux_loss=switch_load_balancing_loss(probs, ids, padding_mask),
            z_loss=router_z_loss(routing.logits, padding_mask),
            seq_aux_loss=sequence_load_balancing_loss(probs.reshape(b, s, e), ids.reshape(b, s, -1), seq_mask),
            util_loss=utilization_loss(probs, padding_mask),
            tokens_per_expert=counts.detach(),
            dropped_per_expert=dropped.detach(),
            prob_sum=(probs * valid[:, None]).sum(dim=0),
            num_tokens=valid.sum(),
            router_logits=routing.logits,
            capacity=capacity,
        )
