"""Single-device token dispatch: lay (token, expert) assignments out expert by expert, and combine the expert outputs
back (the reference :class:`~moetrain.moe.dispatcher.Dispatcher`; docs/dispatchers.md).

Legend: T = tokens, D = hidden, E = experts, K = top-k, N = T * K assignments, R = dispatched rows, C = capacity.

Two layouts: *grouped* (dropless and dropping without padding): R = N rows sorted by expert (stable: token order
within an expert), kept rows first, dropped assignments after the last expert's rows, ``tokens_per_expert`` counting
the kept rows; *capacity* (``capacity=C``: the ``padded`` backend and ``pad_to_capacity``): R = E * C rows, expert e
owning rows ``[e * C, (e + 1) * C)``, kept assignments in the first slots in token order, zero rows after;
``tokens_per_expert`` is C for every expert. Rows without a kept assignment are zero on the way in and ignored on the
way out (``torch.where``, never a multiply, so garbage in them cannot leak NaN).

Dropless, both directions of the permutation are gathers: autograd would differentiate ``x[token_ids]`` and
``y[rows]`` with ``index_put_(accumulate=True)`` (one row at a time on CPU, ~10x slower than a gather; atomics on
CUDA, not deterministic), so :func:`permute_rows` and :func:`combine_rows` make each backward the other gather plus a
fixed-order sum over K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from moetrain.moe.dispatcher import Dispatcher
from moetrain.moe.kernels.cpu import native as cpu_kernels


def route_dropless(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dropless grouped layout (stable sort by expert: token order within an expert).

    On CPU with the native kernels (moe/kernels/cpu/native.py) one counting sort gives the same tensors (0.26 ->
    0.04 ms at T = 4,096, K = 2, E = 8); elsewhere a stable ``torch.sort``.

    Args:
        topk_ids: [T, K] int64 expert of each assignment.
        num_experts: E.
    Returns:
        (token_ids [N] token of each row, rows_of [T, K] row of each assignment, tokens_per_expert [E] int64).
    """
    if (type(topk_ids) is torch.Tensor and topk_ids.device.type == "cpu" and topk_ids.dtype == torch.int64
            and topk_ids.dim() == 2 and topk_ids.is_contiguous() and cpu_kernels.available()):
        return cpu_kernels.route_dropless(topk_ids, num_experts)  # the same tensors, one counting sort
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # [N]
    rows_of = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=flat.device)).view(t, k)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                        torch.ones_like(flat))
    return order // k, rows_of, counts


@dataclass(frozen=True)
class DispatchMeta:
    """What ``combine`` needs to undo ``dispatch``.

    Attributes:
        token_ids: [R] int64 source token of each dispatched row (any valid index for an empty row).
        rows: [T, K] int64 row holding each assignment (any valid row for a dropped one).
        kept: [T, K] bool, False for dropped assignments.
        topk_weights: [T, K] fp32 gating weights.
        dropless: every assignment kept in the grouped layout (R = N, ``rows`` a permutation): dispatch and combine
            then run as gathers both ways (:func:`permute_rows`, :func:`combine_rows`).
    """

    token_ids: torch.Tensor
    rows: torch.Tensor
    kept: torch.Tensor
    topk_weights: torch.Tensor
    dropless: bool = False


class LocalDispatcher(Dispatcher):
    """Single-device dispatch: a stable sort of the N expert ids, a gather in, a gather plus a sum over K out.

    No host-device sync: counts and offsets stay on device (they feed ``grouped_mm`` directly) and the capacity C
    is a Python int from static shapes. Combining sums each token's K outputs in a fixed order (deterministic,
    unlike an atomic ``index_add``).

    Args:
        num_experts: E.
    """

    supports_capacity = True  # accepts ``keep`` / ``capacity`` (dropping and the capacity layout)

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(
        self,
        tokens: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        keep: torch.Tensor | None = None,
        capacity: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMeta]:
        """As :meth:`Dispatcher.dispatch` (rows [R, D], tokens_per_expert [E] int64, :class:`DispatchMeta`)."""
        t, k = topk_ids.shape
        if keep is None and capacity is None:  # every row valid: a gather, whose backward is a gather too
            token_ids, rows, tokens_per_expert = route_dropless(topk_ids, self.num_experts)
            meta = DispatchMeta(token_ids=token_ids, rows=rows, kept=torch.ones_like(topk_ids, dtype=torch.bool),
                                topk_weights=topk_weights, dropless=True)
            return permute_rows(tokens, token_ids, rows), tokens_per_expert, meta
        kept = torch.ones_like(topk_ids, dtype=torch.bool) if keep is None else keep.bool()
        token_ids, row_valid, rows, tokens_per_expert = _dropping_layout(topk_ids, kept, self.num_experts, capacity)
        x_rows = torch.where(row_valid[:, None], tokens[token_ids], 0)  # [R, D]; empty rows are exact zeros
        meta = DispatchMeta(token_ids=token_ids, rows=rows.reshape(t, k), kept=kept, topk_weights=topk_weights)
        return x_rows, tokens_per_expert, meta

    def combine(self, expert_out: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """expert_out: [R, D] expert outputs in dispatch order -> [T, D], ``sum_k kept_k * weight_k * y_k`` per token.

        Dropped assignments contribute exactly zero (selected away before the multiply). The weighted sum
        accumulates in fp32 (bf16 would round each of the K partial sums; fp64 stays fp64) and is returned in
        ``expert_out.dtype``.
        """
        if meta.dropless:
            return combine_rows(expert_out, meta.rows, meta.topk_weights, meta.token_ids)
        t, k = meta.kept.shape
        picked = expert_out[meta.rows.reshape(-1)].reshape(t, k, expert_out.shape[-1])  # [T, K, D]; T may be 0
        acc = torch.promote_types(expert_out.dtype, torch.float32)
        picked = torch.where(meta.kept[..., None], picked.to(acc), 0.0)
        return (picked * meta.topk_weights[..., None].to(acc)).sum(dim=1).to(expert_out.dtype)


def _dropping_layout(topk_ids: torch.Tensor, kept: torch.Tensor, num_experts: int, capacity: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped layout with dropped assignments last, or (``capacity`` C) the capacity layout.

    Args:
        topk_ids: [T, K] int64.  kept: [T, K] bool.  num_experts: E.  capacity: C or ``None``.
    Returns:
        (token_ids [R] int64, row_valid [R] bool, rows [N] int64 row of each assignment, tokens_per_expert [E]).
    """
    t, k = topk_ids.shape
    n, e, device = t * k, num_experts, topk_ids.device
    flat_ids, kept = topk_ids.reshape(-1), kept.reshape(-1)
    key = torch.where(kept, flat_ids, e)  # dropped assignments sort after every expert
    # Stable sort keeps token order inside each expert's group, so results are deterministic.
    order = torch.sort(key, stable=True).indices  # [N]
    token_of = torch.arange(n, device=device) // k  # [N] token of each flat assignment
    kept_counts = torch.zeros(e + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    if capacity is None:
        rows = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=device))  # inverse permutation
        return token_of[order], kept[order], rows, kept_counts[:e]
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
    return token_ids, row_valid, rows, torch.full((e,), capacity, dtype=torch.int64, device=device)


class _PermuteRows(torch.autograd.Function):
    """rows = x[token_ids]; d x[t] = sum_k d rows[rows_of[t, k]] in k order."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, token_ids: torch.Tensor, rows_of: torch.Tensor  # noqa: D102
                ) -> torch.Tensor:
        ctx.save_for_backward(rows_of)
        return x.index_select(0, token_ids)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        (rows_of,) = ctx.saved_tensors
        t, k = rows_of.shape
        picked = grad.index_select(0, rows_of.reshape(-1)).view(t, k, grad.shape[1])  # [T, K, D]
        return picked.sum(dim=1) if k > 1 else picked[:, 0], None, None


def permute_rows(x: torch.Tensor, token_ids: torch.Tensor, rows_of: torch.Tensor) -> torch.Tensor:
    """Dropless dispatch gather.

    Args:
        x: [T, D] tokens.
        token_ids: [N] int64 token of each dispatched row.
        rows_of: [T, K] int64 row of each assignment (``token_ids[rows_of[t, k]] == t``, every row used once).
    Returns:
        [N, D] rows, same dtype as x.
    """
    # Function.apply is untyped in torch's stubs (here and below).
    return cast(torch.Tensor, _PermuteRows.apply(x, token_ids, rows_of))  # type: ignore[no-untyped-call]


class _CombineRows(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * y[rows_of[t, k]], accumulated in fp32 in k order, returned in y's dtype."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, rows_of: torch.Tensor, weights: torch.Tensor,  # noqa: D102
                token_ids: torch.Tensor) -> torch.Tensor:
        t, k = rows_of.shape
        acc = torch.promote_types(y.dtype, torch.float32)  # fp32 accumulator (fp64 for fp64)
        out = torch.zeros(t, y.shape[1], dtype=acc, device=y.device)  # [T, D]
        for j in range(k):
            # Mixed-dtype in-place multiply-add: a bf16 row is widened, never rounded, on its way into out.
            out.addcmul_(y.index_select(0, rows_of[:, j]), weights[:, j, None].to(acc))
        ctx.save_for_backward(y, rows_of, weights, token_ids)
        return out.to(y.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor  # noqa: D102
                 ) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        y, rows_of, weights, token_ids = ctx.saved_tensors
        t, k = rows_of.shape
        g_rows = grad.index_select(0, token_ids)  # [N, D] d out[token of row r]
        dy = dw = None
        if ctx.needs_input_grad[2]:
            # dw[t, k] = <d out[t], y[rows_of[t, k]]>, per row (summed in fp32), then back to (t, k) order by a
            # gather through rows_of.
            dw_rows = torch.mul(g_rows, y).sum(dim=-1, dtype=torch.promote_types(y.dtype, torch.float32))  # [N]
            dw = dw_rows.index_select(0, rows_of.reshape(-1)).view(t, k).to(weights.dtype)
        if ctx.needs_input_grad[0]:
            w_rows = torch.empty(t * k, dtype=weights.dtype, device=y.device)
            w_rows.scatter_(0, rows_of.reshape(-1), weights.reshape(-1))  # [N] weight of each row
            # In place, mixed dtype: computed in fp32 and rounded once to g_rows' dtype.
            dy = g_rows.mul_(w_rows[:, None])
        return dy, None, dw, None


def combine_rows(y: torch.Tensor, rows_of: torch.Tensor, weights: torch.Tensor, token_ids: torch.Tensor
                 ) -> torch.Tensor:
    """Dropless combine: the gating-weighted sum of each token's K expert outputs.

    Args:
        y: [N, D] expert outputs in dispatch order.
        rows_of: [T, K] int64 row of each assignment (a permutation of 0..N-1).
        weights: [T, K] fp32 gating weights.
        token_ids: [N] int64 token of each row (the inverse of ``rows_of``).
    Returns:
        [T, D] in y's dtype, summed in fp32 in k order (deterministic).
    """
    return cast(torch.Tensor, _CombineRows.apply(y, rows_of, weights, token_ids))  # type: ignore[no-untyped-call]
