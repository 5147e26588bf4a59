"""The MoE layer: route -> capacity -> dispatch -> experts -> combine (+ shared expert); returns its output and an
explicit record of losses and counts.

The layer is single-device code: every movement of tokens goes through its dispatcher
(:class:`~moetrain.moe.dispatcher.Dispatcher`): its own (:func:`local_dispatcher`), or expert parallelism's, attached
through :meth:`MoELayer.set_dispatcher` (docs/dispatchers.md).

Legend: B = batch, S = sequence, T = B * S tokens, D = hidden, E = experts, K = top-k, C = capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from moetrain.errors import ConfigError
from moetrain.execution import ExecutionConfig
from moetrain.moe.capacity import capacity_keep, expert_capacity
from moetrain.moe.config import MoEConfig
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.dispatcher import Dispatcher
from moetrain.moe.experts import BACKENDS, RoutedExperts
from moetrain.moe.fast_moe import FusedLocalDispatcher
from moetrain.moe.gate_smoothing import routing_entropy_deficit
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
from moetrain.moe.shared_expert import SharedExpert, shared_output


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
        entropy_loss: scalar fp32 gate-output smoothing loss, the mean entropy deficit of the tokens' routing
            distributions (:func:`~moetrain.moe.gate_smoothing.routing_entropy_deficit`; 0 = uniform gates).
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
    entropy_loss: torch.Tensor | None = None


RoutingHook = Callable[["MoELayer", torch.Tensor], tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]
"""An inference routing policy (serving's dynamic top-k, the int8 router: ``moetrain.serve.routing``): ``(layer,
tokens [T, D]) -> (topk_ids [T, Kmax] int64, gating weights [T, Kmax] fp32, keep [T, Kmax] bool or None)``, in
place of the layer's router and capacity; assignments with ``keep == False`` are dropped (never computed)."""

ExpertProvider = Callable[["MoELayer", torch.Tensor, torch.Tensor], torch.Tensor]
"""Routed experts computed from weights held outside the layer (serving's int8 experts, the hot/cold expert store):
``(layer, rows [R, D] grouped by expert, tokens_per_expert [E] int64) -> [R, D]``, in place of ``layer.experts``."""


class MoELayer(nn.Module):
    """Top-k MoE FFN: router (softmax or sigmoid, groups, expert bias), optional capacity, routed experts
    (SwiGLU or GELU; a named backend of moe/experts.py), optional (gated) shared expert.

    Parameter names follow transformers where they exist: ``router.weight`` [E, D] (HF ``gate.weight``),
    ``router.e_score_correction_bias`` [E], ``experts.gate_up_proj`` / ``experts.up_proj`` and
    ``experts.down_proj``, ``shared_expert.{gate,up,down}_proj.weight`` and ``shared_expert_gate.weight`` [1, D].

    Args:
        hidden: D.
        config: the layer's :class:`MoEConfig` (what it computes).
        execution: how it runs (:class:`~moetrain.execution.ExecutionConfig`: ``moe_backend``,
            ``recompute_experts``); the default is the fused backend without recomputation.
    """

    def __init__(self, hidden: int, config: MoEConfig, execution: ExecutionConfig | None = None):
        super().__init__()
        self.config = config
        self.execution = execution if execution is not None else ExecutionConfig()
        self.router = TopKRouter(hidden, config)
        self.experts = RoutedExperts(config.num_experts, hidden, config.experts.ffn_hidden,
                                     config.experts.activation, self.execution.moe_backend,
                                     recompute=self.execution.recompute_experts)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert.ffn_hidden > 0:
            self.shared_expert = SharedExpert(hidden, config.shared_expert.ffn_hidden, config.experts.activation)
            if config.shared_expert.gate:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.dispatcher: Dispatcher = local_dispatcher(config.num_experts, self.execution.moe_backend)
        self.expert_provider: ExpertProvider | None = None

    def set_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Attach a token dispatcher from outside (expert parallelism: ``moetrain.parallel``), keeping model code
        single-device. ``self.experts`` must then hold exactly the experts it routes rows to
        (``moetrain.parallel.layout.shard_experts``).

        Raises:
            TypeError: ``dispatcher`` is not a :class:`~moetrain.moe.dispatcher.Dispatcher`.
        """
        if not isinstance(dispatcher, Dispatcher):
            raise TypeError(f"set_dispatcher: {type(dispatcher).__name__} is not a moetrain.moe.dispatcher.Dispatcher")
        self.dispatcher = dispatcher

    def set_expert_provider(self, provider: ExpertProvider | None) -> None:
        """Compute the routed experts with ``provider`` (see :data:`ExpertProvider`; ``None``: ``self.experts``).
        Dispatch and combine stay the layer's dispatcher's."""
        self.expert_provider = provider

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                routing: RoutingHook | None = None) -> tuple[torch.Tensor, MoEAux | None]:
        """Args:
            x: [B, S, D] (or [T, D], one sequence).
            padding_mask: [B, S] (or [T]) True for real tokens. Dropless, padding is still routed and computed
                (its output is discarded by the loss); with a capacity it is dropped and takes no slot. Padding
                never counts in the losses or counts.
            routing: an inference routing policy (:data:`RoutingHook`) in place of the router and the capacity;
                then no record is made (the hook keeps what it needs).
        Returns:
            (y with the shape and dtype of x, :class:`MoEAux`, or ``None`` under ``routing``).
        Raises:
            ConfigError: capacity or the padded backend with a dispatcher that only supports dropless dispatch.
            ValueError: ``padding_mask`` does not hold one entry per token of ``x``.
        """
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, D]
        if routing is not None:
            ids, weights, keep = routing(self, tokens)
            return self._compute(tokens, ids, weights, keep, None).reshape(shape), None
        if padding_mask is not None and padding_mask.numel() != shape[:-1].numel():
            raise ValueError(f"padding_mask: shape {tuple(padding_mask.shape)} does not match the tokens' shape "
                             f"{tuple(shape[:-1])} (one entry per token this layer computes; during cached "
                             f"generation the new tokens only)")
        r = self.router(tokens)
        keep, capacity, layout = self._capacity(r, padding_mask)
        y = self._compute(tokens, r.topk_ids, r.topk_weights, keep, layout)
        return y.reshape(shape), self._record(r, shape, padding_mask, keep, capacity)

    def _compute(self, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None,
                 layout: int | None) -> torch.Tensor:
        """Routed experts (dispatch -> experts -> combine), expert dropout and the shared expert: [T, D] -> [T, D]
        in the tokens' dtype."""
        if keep is None and layout is None and self.dispatcher.fuses_experts and self.expert_provider is None:
            # dispatch -> experts -> combine as one step of the experts module (moe/fast_moe.py)
            y = self.dispatcher.forward(tokens, ids, weights, self.experts)
        else:
            rows, tokens_per_expert, meta = self.dispatcher.dispatch(
                tokens, ids, weights, keep=keep, capacity=layout)  # [R, D]
            if self.expert_provider is None:
                expert_out = self.experts(rows, tokens_per_expert)  # [R, D]
            else:
                expert_out = self.expert_provider(self, rows, tokens_per_expert)
            y = self.dispatcher.combine(expert_out, meta)  # [T, D]
        y = y.to(tokens.dtype)
        if self.config.experts.dropout > 0:
            y = F.dropout(y, self.config.experts.dropout, self.training)
        if self.shared_expert is not None:
            y = y + shared_output(self.shared_expert, self.shared_expert_gate, tokens).to(y.dtype)
        return y

    def _capacity(self, routing: Routing, padding_mask: torch.Tensor | None
                  ) -> tuple[torch.Tensor | None, int | None, int | None]:
        """(keep [T, K] bool or ``None`` when dropless, capacity C in force or ``None``, layout: C rows per expert
        for the capacity layout, or ``None`` for the grouped one).

        Raises:
            ConfigError: dropping or padding with a dispatcher that does not declare ``supports_capacity``.
        """
        c, backend = self.config, self.execution.moe_backend
        ids = routing.topk_ids
        keep, capacity, layout = None, None, None
        factor = c.capacity.factor_for(self.training)
        if factor is not None:
            valid = None if padding_mask is None else padding_mask.reshape(-1).to(device=ids.device, dtype=torch.bool)
            capacity = expert_capacity(ids.shape[0], c.top_k, c.num_experts, factor, c.capacity.min_capacity)
            keep = capacity_keep(ids, routing.topk_weights, c.num_experts, capacity, c.capacity.drop_policy, valid)
            if c.capacity.pad_to_capacity or self.experts.kernel.capacity_layout:
                layout = capacity
        elif self.experts.kernel.capacity_layout:
            # Dropless capacity buffers must fit the busiest expert: one host sync (the price of this backend).
            layout = max(int(expert_counts(ids, c.num_experts).max()), 1)
        if (keep is not None or layout is not None) and not self.dispatcher.supports_capacity:
            raise ConfigError(
                f"model.moe.capacity.factor={c.capacity.factor} / model.execution.moe_backend={backend!r} need "
                f"a dispatcher that drops and pads; {type(self.dispatcher).__name__} is dropless only")
        return keep, capacity, layout

    def _loss(self, coeff: float, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``fn(*args)``, without autograd when the loss's coefficient is 0: it is still reported, but saves no
        [T, E] activations for a backward that would multiply them by 0 (the model adds only the terms whose
        coefficient is positive: ``model/transformer.py``)."""
        if coeff > 0:
            return fn(*args)
        with torch.no_grad():
            return fn(*args)

    def _record(self, routing: Routing, shape: torch.Size, padding_mask: torch.Tensor | None,
                keep: torch.Tensor | None, capacity: int | None) -> MoEAux:
        """The layer's losses and counts (all over real tokens)."""
        e, losses = self.config.num_experts, self.config.losses
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
            aux_loss=self._loss(losses.aux_loss_coeff, switch_load_balancing_loss, probs, ids, padding_mask),
            z_loss=self._loss(losses.z_loss_coeff, router_z_loss, routing.logits, padding_mask),
            seq_aux_loss=self._loss(losses.seq_aux_loss_coeff, sequence_load_balancing_loss,
                                    probs.reshape(b, s, e), ids.reshape(b, s, -1), seq_mask),
            util_loss=self._loss(losses.util_loss_coeff, utilization_loss, probs, padding_mask),
            tokens_per_expert=counts.detach(),
            dropped_per_expert=dropped.detach(),
            prob_sum=(probs * valid[:, None]).sum(dim=0),
            num_tokens=valid.sum(),
            router_logits=routing.logits,
            capacity=capacity,
            entropy_loss=self._loss(losses.entropy_loss_coeff, routing_entropy_deficit, probs, padding_mask),
        )


def local_dispatcher(num_experts: int, backend: str) -> Dispatcher:
    """The single-device dispatcher a layer starts with: :class:`~moetrain.moe.fast_moe.FusedLocalDispatcher` for a
    backend with a fused form (``fused``), else :class:`~moetrain.moe.dispatch.LocalDispatcher` (the reference)."""
    fused = BACKENDS[backend].fused is not None
    return FusedLocalDispatcher(num_experts) if fused else LocalDispatcher(num_experts)
