"""Routed experts: E FFNs stored as 3-D tensors, computed by one of four named backends (fused, grouped GEMM, padded
batched GEMM, the reference loop; what each does and costs: docs/experts.md, docs/performance.md).

Legend: R = dispatched rows (grouped by expert), D = hidden, E = experts, F = expert FFN hidden, C = capacity.

Weight layout follows transformers' ``MixtralExperts``: SwiGLU experts hold ``gate_up_proj`` [E, 2F, D] (gate half
first) and ``down_proj`` [E, D, F], expert e computing ``down_e(silu(gate_e x) * up_e x)``; GELU experts hold
``up_proj`` [E, F, D] and ``down_proj`` [E, D, F], computing ``down_e(gelu(up_e x))`` (exact erf GELU, no biases).

Every backend (:data:`BACKENDS`, ``model.execution.moe_backend``; the table in docs/experts.md) computes
``fn(x [R, D], w_in, w_out, tokens_per_expert [E], activation) -> [R, D]`` on rows a dispatcher laid out (rows of
expert e follow those of expert e - 1; rows after the last expert's are ignored) and passes one conformance suite
against the ``loop`` reference (tests/test_moe_backends.py); ``grouped_mm`` is also ``moetrain.hf.accelerate``'s.
Weights are arguments, not module state (:meth:`RoutedExperts.forward`'s ``weights``; a weight provider,
:data:`ExpertWeights`, feeds the per-expert loop one expert at a time).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.moe.expert_ops import ACTIVATIONS, activate, compute_dtype, grouped_mm_aligned, zero_idle
from moetrain.moe.fast_moe import fused_experts, fused_moe
from moetrain.moe.weight_init import DEFAULT_STD, initialise_now


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``F.grouped_mm``'s CPU backward rejects stride-0 (expanded) gradients such as the one ``.sum()`` produces.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


class _ZeroIdleGrad(torch.autograd.Function):
    """Identity on an [E, ...] expert weight whose backward zeroes the gradient of experts with no rows
    (:func:`~moetrain.moe.expert_ops.zero_idle`)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(tokens_per_expert)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        (tokens_per_expert,) = ctx.saved_tensors
        return zero_idle(grad, tokens_per_expert), None


def grouped_experts(
    x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, tokens_per_expert: torch.Tensor,
    activation: str = "swiglu",
) -> torch.Tensor:
    """Dropless experts with two ``torch.nn.functional.grouped_mm`` calls (MegaBlocks-style); no host sync.

    ``grouped_mm`` needs 16-byte aligned rows (it raises "strides should be multiple of 16 bytes" otherwise, e.g.
    fp32 with D not a multiple of 4); with unaligned D, I or F this falls back to :func:`loop_experts` (same maths,
    one host sync to read the counts), as the fused path falls back from its grouped to its tiles mode.

    Args:
        x: [R, D] rows grouped by expert (expert 0's rows first).
        w_in: [E, 2F, D] (swiglu) or [E, F, D] (gelu).
        w_out: [E, D, F].
        tokens_per_expert: [E] int rows per expert (sums to <= R; zeros allowed).
        activation: ``swiglu`` or ``gelu``.
    Returns:
        [R, D] in the compute dtype (the autocast dtype under autocast).
    """
    dtype = compute_dtype(x, w_in)
    if not grouped_mm_aligned(dtype, x.shape[1], w_in.shape[1], w_out.shape[2]):
        return loop_experts(x, w_in, w_out, tokens_per_expert, activation)
    offs = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)  # [E] end offset of each group
    # Function.apply is untyped in torch's stubs.
    w_in = _ZeroIdleGrad.apply(w_in, tokens_per_expert)  # type: ignore[no-untyped-call]
    w_out = _ZeroIdleGrad.apply(w_out, tokens_per_expert)  # type: ignore[no-untyped-call]
    h = F.grouped_mm(x.to(dtype), w_in.to(dtype).transpose(-2, -1), offs=offs)  # [R, 2F] or [R, F]
    a = activate(_ContiguousGrad.apply(h), activation)  # type: ignore[no-untyped-call]
    y = F.grouped_mm(a, w_out.to(dtype).transpose(-2, -1), offs=offs)  # [R, D]
    return cast(torch.Tensor, _ContiguousGrad.apply(y))  # type: ignore[no-untyped-call]


def padded_experts(
    x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, tokens_per_expert: torch.Tensor,
    activation: str = "swiglu",
) -> torch.Tensor:
    """Experts on capacity buffers: x viewed as [E, C, D], two ``torch.bmm`` (GShard / Switch style).

    Needs the capacity layout (every expert owns exactly C rows, R = E * C; see moe/dispatch.py); empty slots are
    zero rows, which every activation maps to zero. Same arguments as :func:`grouped_experts`.

    Raises:
        ValueError: R is not a multiple of E.
    """
    e = w_in.shape[0]
    if x.shape[0] % e:
        raise ValueError(f"padded experts need the capacity layout: {x.shape[0]} rows for {e} experts")
    dtype = compute_dtype(x, w_in)
    xb = x.to(dtype).reshape(e, x.shape[0] // e, x.shape[1])  # [E, C, D]
    h = torch.bmm(xb, w_in.to(dtype).transpose(1, 2))  # [E, C, 2F] or [E, C, F]
    y = torch.bmm(activate(h, activation), w_out.to(dtype).transpose(1, 2))  # [E, C, D]
    return y.reshape(x.shape[0], x.shape[1])


ExpertWeights = Callable[[list[int]], Iterable[tuple[int, torch.Tensor, torch.Tensor, "torch.Tensor | None",
                                                    "torch.Tensor | None"]]]
"""A weight provider (int8 copies, experts paged in from disk): given the experts that have rows (ascending), yields
each one's weights lazily, one expert at a time, in the order it chooses: ``(e, w_in_e [I, D], w_out_e [D, F],
s_in [I] or None, s_out [D] or None)``. A weight may be stored in another dtype (int8): :func:`expert_loop` converts
it to the compute dtype expert by expert. ``s`` is a per-output-row scale of a weight-only quantised weight: the
expert computes ``(x @ w^T) * s``, the product ``x @ (s w)^T`` without a scaled copy of the weight."""


def expert_loop(x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: ExpertWeights, activation: str,
                dtype: torch.dtype) -> torch.Tensor:
    """The per-expert GEMM loop every provider and :func:`loop_experts` run: rows [R, D] grouped by expert,
    tokens_per_expert [E] -> [R, D] in ``dtype``, one pair of matmuls per expert that ``weights`` yields. Syncs with
    the host once to read the counts; rows after the last group are zero.

    Raises:
        ValueError: ``weights`` left out an expert that has rows.
    """
    counts = tokens_per_expert.tolist()
    starts = [0, *itertools.accumulate(counts)]  # [E + 1] first row of each expert
    used = [e for e, n in enumerate(counts) if n]
    x = x.to(dtype=dtype)  # keyword form: the cheapest call of the per-expert conversions below (~1 us each)
    pieces: dict[int, torch.Tensor] = {}  # expert -> its rows' output [n_e, D], in whatever order weights yields
    for e, w_in, w_out, s_in, s_out in weights(used):
        a, b = starts[e], starts[e + 1]
        h = x[a:b] @ w_in.to(dtype=dtype).T  # [n_e, I]
        y = activate(h if s_in is None else h.mul_(s_in), activation) @ w_out.to(dtype=dtype).T  # [n_e, D]
        pieces[e] = y if s_out is None else y.mul_(s_out)  # a quantised weight's row scale (inference)
    missing = [e for e in used if e not in pieces]
    if missing:
        raise ValueError(f"weights: the provider left out experts {missing}, which have rows (all with rows: {used})")
    # One cat in expert order, not writes into a zeroed [R, D]: each in-place slice write is an autograd CopySlices
    # whose backward clones the whole gradient, O(E * R * D) in all (1.6x the step at E = 64).
    tail = x.new_zeros(x.shape[0] - starts[-1], x.shape[1], dtype=dtype)  # rows after the last group
    return torch.cat([pieces[e] for e in sorted(pieces)] + [tail])


def loop_experts(
    x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, tokens_per_expert: torch.Tensor,
    activation: str = "swiglu",
) -> torch.Tensor:
    """Reference: a plain Python loop over experts, one pair of dense matmuls each (:func:`expert_loop`; same
    arguments as :func:`grouped_experts`); every other path is tested against it, and :func:`grouped_experts` falls
    back to it for unaligned rows."""
    every = range(w_in.shape[0])  # idle experts too: their weights get exact zero gradients
    return expert_loop(x, tokens_per_expert, lambda used: ((e, w_in[e], w_out[e], None, None) for e in every),
                       activation, compute_dtype(x, w_in))


@dataclass(frozen=True)
class ExpertBackend:
    """One named way to compute the routed experts (see the module docstring).

    Attributes:
        name: the ``model.execution.moe_backend`` value.
        experts: ``fn(x [R, D], w_in [E, I, D], w_out [E, D, F], tokens_per_expert [E], activation) -> [R, D]`` on
            rows a dispatcher laid out (``recompute=`` as a keyword too when :attr:`recomputes`).
        fused: ``fn(tokens [T, D], topk_ids [T, K], topk_weights [T, K], w_in, w_out, activation, *, recompute)
            -> [T, D]``, dropless dispatch + experts + combine on one device as one step; ``None`` when the backend
            has no such form (the layer then dispatches, runs :attr:`experts` and combines).
        capacity_layout: needs the capacity layout (C rows per expert), dropless too.
        recomputes: :attr:`experts` and :attr:`fused` recompute themselves when asked; the others run under
            ``torch.utils.checkpoint``.
    """

    name: str
    experts: Callable[..., torch.Tensor]
    fused: Callable[..., torch.Tensor] | None = None
    capacity_layout: bool = False
    recomputes: bool = False


BACKENDS = {b.name: b for b in (
    ExpertBackend("fused", fused_experts, fused=fused_moe, recomputes=True),
    ExpertBackend("grouped_mm", grouped_experts),
    ExpertBackend("padded", padded_experts, capacity_layout=True),
    ExpertBackend("loop", loop_experts),
)}


class RoutedExperts(nn.Module):
    """E routed experts as 3-D weights (names and layouts as transformers, see the module docstring).

    Args:
        num_experts: E.  hidden: D.  ffn_hidden: F.
        activation: ``swiglu`` (``gate_up_proj``, ``down_proj``) or ``gelu`` (``up_proj``, ``down_proj``).
        backend: a name in :data:`BACKENDS` (``fused``, ``grouped_mm``, ``padded`` or ``loop``), kept as
            :attr:`kernel`.
        recompute: keep none of the experts' intermediate activations for backward (``fused``: its Function saves
            not even the pre-activation; the others run under ``torch.utils.checkpoint``). Same outputs and
            gradients.
    Raises:
        ValueError: unknown backend or activation.
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, activation: str = "swiglu",
                 backend: str = "fused", recompute: bool = False):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"model.execution.moe_backend: unknown backend {backend!r}; choose one of "
                             f"{sorted(BACKENDS)}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"model.moe.experts.activation: unknown activation {activation!r}; choose one of "
                             f"{list(ACTIVATIONS)}")
        self.kernel = BACKENDS[backend]
        self.activation = activation
        self.recompute = recompute
        if activation == "swiglu":
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden, hidden))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        if initialise_now():  # not inside MoETransformer, which draws every weight itself (moe/weight_init.py)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = DEFAULT_STD) -> None:
        """Every expert weight ~ Normal(0, std): ``gate_up_proj`` [E, 2F, D] (or ``up_proj`` [E, F, D]) and
        ``down_proj`` [E, D, F], fp32 unless the module was cast. ``MoETransformer.reset_parameters`` draws them
        itself, ``down_proj``'s at std / sqrt(2 n_layers) (GPT-2's residual scaling)."""
        for p in self.parameters():
            p.normal_(0.0, std)

    @property
    def w_in(self) -> torch.Tensor:
        """The input projection: ``gate_up_proj`` [E, 2F, D] or ``up_proj`` [E, F, D]."""
        return self.gate_up_proj if self.activation == "swiglu" else self.up_proj

    @property
    def num_experts(self) -> int:
        """Experts held by this module (E, or E / ep on an expert-parallel rank)."""
        return self.down_proj.shape[0]

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor | None = None, *,
                topk_ids: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The routed experts, in one of two forms; activation checkpointing of this module covers both.

        Args:
            x: rows [R, D] grouped by expert (with ``tokens_per_expert``), or tokens [T, D] (with ``topk_ids`` and
                ``topk_weights``: the backend's :attr:`ExpertBackend.fused` form, dropless on one device).
            tokens_per_expert: [E] int64 rows per expert.
            topk_ids: [T, K] int64 experts of each token.
            topk_weights: [T, K] fp32 gating weights (differentiable).
            weights: (w_in [E, I, D], w_out [E, D, F]) to use instead of this module's parameters (with rows,
                experts that have no rows may be left out of the weights and the counts).
        Returns:
            [R, D] expert outputs, or [T, D] combined outputs, in the compute dtype (the autocast dtype under
            autocast, else the weights').
        Raises:
            ValueError: neither or both forms given, or the tokens form on a backend without one.
        """
        rows = tokens_per_expert is not None
        if rows == (topk_ids is not None and topk_weights is not None):
            raise ValueError("RoutedExperts: give either tokens_per_expert (rows) or topk_ids and topk_weights "
                             "(tokens)")
        w_in, w_out = weights if weights is not None else (self.w_in, self.down_proj)
        kernel = self.kernel
        if not rows:
            if kernel.fused is None:
                raise ValueError(f"RoutedExperts: the {kernel.name!r} backend has no fused (tokens) form; "
                                 f"dispatch the rows and pass tokens_per_expert")
            return kernel.fused(x, topk_ids, topk_weights, w_in, w_out, self.activation, recompute=self.recompute)
        args = (x, w_in, w_out, tokens_per_expert, self.activation)
        if kernel.recomputes:
            return kernel.experts(*args, recompute=self.recompute)
        if self.recompute and torch.is_grad_enabled():
            # torch.utils.checkpoint returns Any
            return cast(torch.Tensor, checkpoint(kernel.experts, *args, use_reentrant=False))
        return kernel.experts(*args)
