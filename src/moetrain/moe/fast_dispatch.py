"""Dropless permute and combine as autograd Functions whose backward is a gather, never a scatter.

Legend: T = tokens, D = hidden, K = top-k, N = T * K assignments = dispatched rows.

In the dropless grouped layout (see moe/dispatch.py) every token owns exactly K rows, so both directions of the
permutation are gathers: ``token_ids`` [N] maps a row to its token and ``rows`` [T, K] a token's assignments to
their rows. Autograd differentiates ``x[token_ids]`` and ``y[rows]`` with ``index_put_(accumulate=True)``, whose
CPU kernel adds one row at a time (about 10x slower than a gather of the same bytes, and on CUDA it needs
atomics, so it is not deterministic); here the backward of each gather is the other gather plus a fixed-order sum
over K. Same results as the autograd path up to summation order (tests/test_perf_experts.py).
"""

from __future__ import annotations

import torch


class _PermuteRows(torch.autograd.Function):
    """rows = x[token_ids]; d x[t] = sum_k d rows[rows_of[t, k]] in k order."""

    @staticmethod
    def forward(ctx, x, token_ids, rows_of):  # noqa: D102
        ctx.save_for_backward(rows_of)
        return x.index_select(0, token_ids)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
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
    return _PermuteRows.apply(x, token_ids, rows_of)


class _CombineRows(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * y[rows_of[t, k]], accumulated in fp32 in k order, returned in y's dtype."""

    @staticmethod
    def forward(ctx, y, rows_of, weights, token_ids):  # noqa: D102
        t, k = rows_of.shape
        acc = torch.promote_types(y.dtype, torch.float32)  # fp32 accumulator (fp64 for fp64)
        out = torch.zeros(t, y.shape[1], dtype=acc, device=y.device)  # [T, D]
        for j in range(k):
            # Mixed-dtype in-place multiply-add: a bf16 row is widened, never rounded, on its way into out.
            out.addcmul_(y.index_select(0, rows_of[:, j]), weights[:, j, None].to(acc))
        ctx.save_for_backward(y, rows_of, weights, token_ids)
        return out.to(y.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
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
    return _CombineRows.apply(y, rows_of, weights, token_ids)
