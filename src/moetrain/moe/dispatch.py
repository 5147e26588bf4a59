"""Token dispatch: permute (token, expert) assignments into expert-contiguous order, and combine them back.

Legend: T = tokens, D = hidden, E = experts, K = top-k, N = T * K assignments.

The local dispatcher is the single-device reference; expert-parallel dispatchers implement the same
``dispatch`` / ``combine`` pair, so model code never sees communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchMeta:
    """What ``combine`` needs to undo ``dispatch``.

    Attributes:
        token_ids: [N] int64, the source token of each permuted row (rows are grouped by expert, ascending).
        weights: [N] fp32 gating weight of each permuted row.
        tokens_per_expert: [E] int64 rows per expert.
        num_tokens: T.
    """

    token_ids: torch.Tensor
    weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: int


class LocalDispatcher:
    """Single-device dropless dispatch: one stable sort of the N expert ids, a gather, and an ``index_add``.

    No host-device sync: the per-expert counts stay on device (they feed ``grouped_mm`` offsets directly).
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMeta]:
        """Args:
            x: [T, D] tokens.
            topk_ids: [T, K] int64 expert of each assignment.
            topk_weights: [T, K] fp32 gating weights.
        Returns:
            (x_permuted [N, D] grouped by expert, tokens_per_expert [E] int64, meta).
        """
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)  # [N]
        # Stable sort keeps token order inside each expert's group, so results are deterministic.
        order = torch.sort(flat_ids, stable=True).indices  # [N]
        token_ids = order // k
        tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        tokens_per_expert.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        meta = DispatchMeta(
            token_ids=token_ids,
            weights=topk_weights.reshape(-1)[order],
            tokens_per_expert=tokens_per_expert,
            num_tokens=x.shape[0],
        )
        return x[token_ids], tokens_per_expert, meta

    def combine(self, y: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """y: [N, D] expert outputs in dispatch order -> [T, D], ``sum_k weight_k * y_k`` per token.

        The weighted sum accumulates in fp32 (bf16 ``index_add`` would round each of the K partial sums).
        """
        weighted = y.float() * meta.weights[:, None]  # [N, D] fp32
        out = torch.zeros(meta.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        return out.index_add_(0, meta.token_ids, weighted).to(y.dtype)
