"""Routed experts: E SwiGLU FFNs stored as 3-D tensors, computed by grouped GEMM or a reference loop.

Legend: N = dispatched rows (grouped by expert), D = hidden, E = experts, F = expert FFN hidden.

Weight layout follows transformers' ``MixtralExperts``: ``gate_up_proj`` [E, 2F, D] (gate half first) and
``down_proj`` [E, D, F]; expert e computes ``down_e(silu(gate_e x) * up_e x)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``F.grouped_mm``'s CPU backward rejects stride-0 (expanded) gradients such as the one ``.sum()`` produces.
    """

    @staticmethod
    def forward(ctx, x):  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad.contiguous()


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (``grouped_mm`` has no autocast rule), else the weight's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def grouped_swiglu(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Dropless SwiGLU experts with two ``torch.nn.functional.grouped_mm`` calls (MegaBlocks-style).

    Args:
        x: [N, D] rows grouped by expert (expert 0's rows first).
        gate_up_proj: [E, 2F, D].
        down_proj: [E, D, F].
        tokens_per_expert: [E] int rows per expert (sums to N; zeros allowed).
    Returns:
        [N, D] in the compute dtype (the autocast dtype under autocast).
    """
    dtype = _compute_dtype(x, gate_up_proj)
    offs = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)  # [E] end offset of each group
    h = F.grouped_mm(x.to(dtype), gate_up_proj.to(dtype).transpose(-2, -1), offs=offs)  # [N, 2F]
    gate, up = _ContiguousGrad.apply(h).chunk(2, dim=-1)
    a = F.silu(gate) * up  # [N, F]
    y = F.grouped_mm(a, down_proj.to(dtype).transpose(-2, -1), offs=offs)  # [N, D]
    return _ContiguousGrad.apply(y)


def loop_swiglu(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Reference: a plain Python loop over experts, one pair of dense matmuls each (same args as
    :func:`grouped_swiglu`). Syncs with the host once to read the counts."""
    dtype = _compute_dtype(x, gate_up_proj)
    outs = []
    start = 0
    for e, count in enumerate(tokens_per_expert.tolist()):
        xe = x[start : start + count].to(dtype)  # [n_e, D]
        gate, up = (xe @ gate_up_proj[e].to(dtype).T).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ down_proj[e].to(dtype).T)
        start += count
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, x.shape[1], dtype=dtype)


BACKENDS = {"grouped_mm": grouped_swiglu, "loop": loop_swiglu}


class SwiGLUExperts(nn.Module):
    """E SwiGLU experts with weights ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F].

    Args:
        num_experts: E.  hidden: D.  ffn_hidden: F.
        backend: ``grouped_mm`` or ``loop`` (see :data:`BACKENDS`).
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, backend: str = "grouped_mm"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"model.moe.backend: unknown backend {backend!r}; choose one of {sorted(BACKENDS)}")
        self.backend = backend
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: [N, D] grouped by expert, tokens_per_expert: [E] -> [N, D]."""
        return BACKENDS[self.backend](x, self.gate_up_proj, self.down_proj, tokens_per_expert)
