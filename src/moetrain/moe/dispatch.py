"""Token dispatch: lay (token, expert) assignments out expert by expert, and combine the expert outputs back.

Legend: T = tokens, D = hidden, E = experts, K = top-k, N = T * K assignments, R = dispatched rows, C = capacity.

Two layouts:
- *grouped* (dropless and dropping without padding): R = N rows sorted by expert (a stable sort, so tokens keep
  their order within an expert), kept rows first, dropped assignments after the last expert's rows;
  ``tokens_per_expert`` counts the kept rows only.
- *capacity* (``capacity=C``: the ``padded`` backend and ``pad_to_capacity``): R = E * C rows, expert e owning
  rows ``[e * C, (e + 1) * C)``; kept assignments fill the first slots in token order, the rest are zero rows;
  ``tokens_per_expert`` is C for every expert (static shapes).

Rows that hold no kept assignment are zero on the way in and ignored on the way out (``torch.where``, never a
multiply, so garbage in them, e.g. the unspecified output of ``grouped_mm`` past its last group, cannot leak NaN
into outputs or gradients).

The local dispatcher is the single-device reference; expert-parallel dispatchers implement the same
``dispatch(x, topk_ids, topk_weights) -> (rows, tokens_per_expert, meta)`` / ``combine(y, meta)`` pair, so model
code never sees communication. The MoE layer passes ``keep`` / ``capacity`` only when it drops or pads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.moe.fast_dispatch import combine_rows, permute_rows


@dataclass(frozen=True)
class DispatchMeta:
    """What ``combine`` needs to undo ``dispatch``.

    Attributes:
        token_ids: [R] int64 source token of each dispatched row (any valid index for an empty row).
        row_valid: [R] bool, True for rows that hold a kept assignment.
        rows: [T, K] int64 row holding each assignment (any valid row for a dropped one).
        kept: [T, K] bool, False for dropped assignments.
        topk_weights: [T, K] fp32 gating weights.
        tokens_per_expert: [E] int64 rows per expert in the dispatched layout.
        num_tokens: T.
        capacity: C for the capacity layout, ``None`` for the grouped layout.
        dropless: every assignment kept in the grouped layout (R = N, ``rows`` a permutation): dispatch and combine
            then run as gathers both ways (moe/fast_dispatch.py).
    """

    token_ids: torch.Tensor
    row_valid: torch.Tensor
    rows: torch.Tensor
    kept: torch.Tensor
    topk_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: int
    capacity: int | None = None
    dropless: bool = False


class LocalDispatcher:
    """Single-device dispatch: a stable sort of the N expert ids, a gather in, a gather plus a sum over K out.

    No host-device sync: counts and offsets stay on device (they feed ``grouped_mm`` directly) and the capacity C
    is a Python int from static shapes. Combining sums each token's K outputs in a fixed order (deterministic,
    unlike an atomic ``index_add``).
    """

    supports_capacity = True  # accepts ``keep`` / ``capacity`` (dropping and the capacity layout)

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        keep: torch.Tensor | None = None,
        capacity: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMeta]:
        """Args:
            x: [T, D] tokens.
            topk_ids: [T, K] int64 expert of each assignment.
            topk_weights: [T, K] fp32 gating weights.
            keep: [T, K] bool, False for dropped assignments; ``None`` keeps all.
            capacity: C selects the capacity layout (the caller guarantees <= C kept assignments per expert);
                ``None`` the grouped layout.
        Returns:
            (rows [R, D] grouped by expert, tokens_per_expert [E] int64 rows per expert, meta).
        """
        t, k = topk_ids.shape
        n, e, device = t * k, self.num_experts, x.device
        flat_ids = topk_ids.reshape(-1)
        kept = torch.ones(n, dtype=torch.bool, device=device) if keep is None else keep.reshape(-1).bool()
        key = torch.where(kept, flat_ids, e)  # dropped assignments sort after every expert
        # Stable sort keeps token order inside each expert's group, so results are deterministic.
        order = torch.sort(key, stable=True).indices  # [N]
        token_of = torch.arange(n, device=device) // k  # [N] token of each flat assignment
        kept_counts = torch.zeros(e + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
        if capacity is None:
            token_ids = token_of[order]
            row_valid = kept[order]
            rows = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=device))  # inverse permutation
            tokens_per_expert = kept_counts[:e]
        else:
            # Row j = e * C + r holds the r-th kept assignment of expert e (token order), i.e. sorted position
            # start[e] + r, when r < count[e]; a pure gather, so no write ever collides.
            start = torch.cumsum(kept_counts, 0) - kept_counts  # [E + 1]
            j = torch.arange(e * capacity, device=device)
            expert, slot = j // capacity, j % capacity
            row_valid = slot < kept_counts[expert]
            src = (start[expert] + slot).clamp(max=max(n - 1, 0))
            token_ids = token_of[order[src]] if n > 0 else torch.zeros_like(j)
            rank_sorted = torch.arange(n, device=device) - start[key[order]]  # slot of each sorted assignment
            rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
            rows = torch.where(kept, flat_ids * capacity + rank, 0)
            tokens_per_expert = torch.full((e,), capacity, dtype=torch.int64, device=device)
        dropless = keep is None and capacity is None
        if dropless:  # every row valid: a gather, whose backward is a gather too (no serial scatter-add on CPU)
            x_rows = permute_rows(x, token_ids, rows.reshape(t, k))
        else:
            x_rows = torch.where(row_valid[:, None], x[token_ids], 0)  # [R, D]; empty rows are exact zeros
        meta = DispatchMeta(
            token_ids=token_ids,
            row_valid=row_valid,
            rows=rows.reshape(t, k),
            kept=kept.reshape(t, k),
            topk_weights=topk_weights,
            tokens_per_expert=tokens_per_expert,
            num_tokens=t,
            capacity=capacity,
            dropless=dropless,
        )
        return x_rows, tokens_per_expert, meta

    def combine(self, y: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """y: [R, D] expert outputs in dispatch order -> [T, D], ``sum_k kept_k * weight_k * y_k`` per token.

        Dropped assignments contribute exactly zero (selected away before the multiply). The weighted sum
        accumulates in fp32 (bf16 would round each of the K partial sums) and is returned in ``y.dtype``.
        """
        if meta.dropless:
            return combine_rows(y, meta.rows, meta.topk_weights, meta.token_ids)
        t, k = meta.kept.shape
        picked = y[meta.rows.reshape(-1)].reshape(t, k, -1)  # [T, K, D]
        picked = torch.where(meta.kept[..., None], picked.float(), 0.0)
        return (picked * meta.topk_weights[..., None].float()).sum(dim=1).to(y.dtype)
