"""The dispatcher seam: how a MoE layer's (token, expert) assignments reach the experts and come back
(docs/dispatchers.md).

Legend: T = tokens, D = hidden, E = experts, K = top-k, R = rows handed to the experts, C = capacity.

Model code is single-device (torchtitan's ``token_dispatcher.py``): the layer routes, decides capacity, then calls
``dispatch`` -> its experts -> ``combine``; everything that moves tokens lives behind this interface, and parallel
code attaches its own dispatcher from outside (``MoELayer.set_dispatcher``; the implementations: the table in
docs/dispatchers.md). Capabilities are class attributes, never probed; tests/test_dispatcher_conformance.py checks
every implementation against the per-expert loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from moetrain.moe.experts import RoutedExperts


class Dispatcher(ABC):
    """Lays (token, expert) assignments out expert by expert for the experts, and sums the experts' outputs back
    per token, weighted by the gating weights.

    Attributes:
        num_experts: E, all experts of the layer (over the EP group for an expert-parallel dispatcher).
        supports_capacity: ``dispatch`` accepts ``keep`` (dropping) and ``capacity`` (the capacity layout). A
            dispatcher that does not raises ``ValueError`` naming both arguments (:meth:`require_dropless`).
        fuses_experts: :meth:`forward` runs dispatch + experts + combine as one step (dropless only).
    """

    supports_capacity: ClassVar[bool] = False
    fuses_experts: ClassVar[bool] = False
    num_experts: int

    @abstractmethod
    def dispatch(
        self,
        tokens: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        keep: torch.Tensor | None = None,
        capacity: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Args:
            tokens: [T, D].
            topk_ids: [T, K] int64 expert of each assignment (global ids).
            topk_weights: [T, K] fp32 gating weights (differentiable).
            keep: [T, K] bool, False for assignments dropped by the capacity limit; ``None`` keeps all.
            capacity: C selects the capacity layout (C rows per expert, the caller guarantees at most C kept
                assignments per expert); ``None`` the grouped layout.
        Returns:
            (rows [R, D] grouped by expert, tokens_per_expert [E_local] int64 rows per expert, meta: an immutable
            record that :meth:`combine` needs).
        Raises:
            ValueError: ``keep`` / ``capacity`` given to a dispatcher without :attr:`supports_capacity`.
        """

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, meta: Any) -> torch.Tensor:
        """expert_out: [R, D] expert outputs in dispatch order -> [T, D] in expert_out's dtype,
        ``sum_k kept_k * weight_k * expert_out_k`` per token (dropped assignments add exactly zero)."""

    def forward(self, tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: RoutedExperts) -> torch.Tensor:
        """Dropless dispatch -> experts -> combine as one step: [T, D] -> [T, D]. Only for a dispatcher that
        declares :attr:`fuses_experts`.

        Raises:
            NotImplementedError: this dispatcher does not fuse the experts.
        """
        raise NotImplementedError(f"{type(self).__name__} declares fuses_experts=False: call dispatch / combine")

    def require_dropless(self, keep: torch.Tensor | None, capacity: int | None) -> None:
        """For dispatchers without :attr:`supports_capacity`: one clear error when dropping or padding is asked.

        Raises:
            ValueError: ``keep`` or ``capacity`` is given.
        """
        if keep is not None or capacity is not None:
            raise ValueError(f"keep / capacity: {type(self).__name__} is dropless only (supports_capacity=False); "
                             f"got keep={'None' if keep is None else tuple(keep.shape)}, capacity={capacity}")
