"""Differentiable collectives used by the expert-parallel dispatchers (each backward is the reverse collective).

Legend: R = rows, D = hidden, P = ranks in the group.

Each forward and backward runs inside :func:`~moetrain.parallel.comm.named_collective`, so a failed peer is
reported with the collective's name. All functions are SPMD: every rank of the group must call them in the same
order, in forward and in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from moetrain.parallel.comm import named_collective

# torch >= 2.10 names; older releases (pyproject allows torch >= 2.8) have the *_tensor spellings.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_to_all_rows(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | None, name: str
) -> torch.Tensor:
    """Non-differentiable ``all_to_all_single`` along dim 0: ``x`` [sum(input_splits), ...] ->
    [sum(output_splits), ...]; rows ``input_splits[p]`` go to rank p of ``group``."""
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    with named_collective(name, group):
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, name: str) -> torch.Tensor:
    """Non-differentiable all-gather along dim 0: [R, ...] on each of ``size`` ranks -> [size * R, ...]."""
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    with named_collective(name, group):
        _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, name: str) -> torch.Tensor:
    """Non-differentiable sum-reduce-scatter along dim 0: [size * R, ...] -> [R, ...] (rank p gets block p)."""
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    with named_collective(name, group):
        _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class Exchange(torch.autograd.Function):
    """A collective ``forward(x)`` whose backward is the reverse collective ``backward(grad)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],  # noqa: D102
                backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.reverse = backward
        return forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        return ctx.reverse(grad), None, None


def _exchange(x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],
              backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return cast(torch.Tensor, Exchange.apply(x, forward, backward))  # type: ignore[no-untyped-call]


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | None,
               name: str) -> torch.Tensor:
    """Differentiable :func:`all_to_all_rows` (uneven splits); backward sends the gradients back with the splits
    swapped."""
    return _exchange(x, lambda t: all_to_all_rows(t, output_splits, input_splits, group, name),
                     lambda g: all_to_all_rows(g, input_splits, output_splits, group, f"{name} [backward]"))


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, name: str) -> torch.Tensor:
    """Differentiable :func:`all_gather_rows`; backward: the sum-reduce-scatter of the gradient (the gathered rows
    collect the gradient every rank computed for them)."""
    return _exchange(x, lambda t: all_gather_rows(t, group, size, name),
                     lambda g: reduce_scatter_rows(g, group, size, f"{name} [backward]"))


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, name: str) -> torch.Tensor:
    """Differentiable :func:`reduce_scatter_rows`; backward: the all-gather of the gradient."""
    return _exchange(x, lambda t: reduce_scatter_rows(t, group, size, name),
                     lambda g: all_gather_rows(g, group, size, f"{name} [backward]"))


class KeepGradPath(torch.autograd.Function):
    """Identity on ``y`` whose backward also hands ``received`` a zero gradient.

    Why: the dispatch exchange's backward is a collective, so it must run on every rank. If this rank's experts
    received no rows, their output may not depend on the received tensor at all, autograd would then skip the
    exchange's backward here and the peers would wait in it until the time-out. The cost is one zero [R, D] tensor
    added in backward.
    """

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, received: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.received_meta = (received.shape, received.dtype, received.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # noqa: D102
        shape, dtype, device = ctx.received_meta
        zero = torch.zeros(shape, dtype=dtype, device=device) if ctx.needs_input_grad[1] else None
        return grad, zero


def wire_dtype(x: torch.Tensor) -> torch.Tensor:
    """Dispatched rows ``x`` in the autocast dtype when autocast is on (else unchanged), for sending to experts.

    The experts cast their input rows to the autocast dtype first thing (``grouped_mm`` has no autocast rule), so
    casting the rows (after the local permute, never the tokens before it, whose gradient sums K rows in fp32)
    before the exchange computes exactly the same thing and halves the bytes sent in bf16 (the backward exchange
    carries bf16 gradients likewise).
    """
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x
