"""Building blocks shared by every routed-expert backend (moe/experts.py, moe/fast_moe.py): the activations, their
hand-written backward, the compute-dtype rule and ``grouped_mm``'s alignment rule.

Legend: n = rows, F = expert FFN hidden, I = input-projection width (2F for SwiGLU, F for GELU), h = [gate | up]
pre-activation [n, I] (SwiGLU) or [n, F] (GELU).

SwiGLU is ``silu(gate) * up`` (gate half first, transformers' ``gate_up_proj`` layout); GELU is the exact (erf)
GELU. :func:`activate` is the autograd form (the ``grouped_mm`` / ``padded`` / ``loop`` backends); the ``*_out``
functions write into preallocated buffers for the fused Function, whose backward calls :func:`act_recompute` and
:func:`act_grad` (``aten.silu_backward`` / ``aten.gelu_backward``, the gradients of gate and up written straight
into the one buffer the next GEMM reads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("swiglu", "gelu")

_silu_out = torch.ops.aten.silu.out
_silu_backward_out = torch.ops.aten.silu_backward.grad_input
_gelu_out = torch.ops.aten.gelu.out
_gelu_backward_out = torch.ops.aten.gelu_backward.grad_input

# grouped_mm (CPU and CUDA) needs every operand's row stride to be a multiple of 16 bytes: it raises "strides should
# be multiple of 16 bytes" otherwise (e.g. fp32 with a hidden size that is not a multiple of 4).
GROUPED_MM_ALIGN_BYTES = 16


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: the autocast dtype when autocast is on for ``x``'s device (``grouped_mm``
    and the fused Function have no autocast rule of their own), else ``weight``'s dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def grouped_mm_aligned(dtype: torch.dtype, *widths: int) -> bool:
    """Whether ``grouped_mm`` accepts rows of these widths (elements) in ``dtype``: every row a multiple of
    :data:`GROUPED_MM_ALIGN_BYTES` bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    return hasattr(F, "grouped_mm") and all(w * size % GROUPED_MM_ALIGN_BYTES == 0 for w in widths)


def zero_idle(grad: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """An [E, ...] weight gradient with exact zeros for experts with no rows: a grouped-GEMM kernel need not write an
    empty group's gradient (the memory may hold anything, NaN included), and ``torch.where`` clears it where a
    multiply would not (0 * NaN = NaN). One elementwise pass, no host sync."""
    active = (tokens_per_expert > 0).reshape(-1, *([1] * (grad.dim() - 1)))
    return torch.where(active, grad, 0.0)


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Autograd activation: [.., 2F] -> silu(gate) * up for ``swiglu``; [.., F] -> gelu for ``gelu``."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


def act_forward(h: torch.Tensor, a: torch.Tensor, activation: str) -> None:
    """a [n, F] = silu(gate) * up (h = [gate | up]) or gelu(h), written in place."""
    if activation == "swiglu":
        ffn = a.shape[1]
        _silu_out(h[:, :ffn], out=a)
        a.mul_(h[:, ffn:])
    else:
        _gelu_out(h, out=a)


def act_recompute(h: torch.Tensor, a: torch.Tensor | None, sg: torch.Tensor | None, activation: str) -> None:
    """Backward's recomputation from h [n, I]: sg = silu(gate) [n, F] (SwiGLU), and, when ``a`` [n, F] is given,
    the activation itself (silu(gate) * up from the same sg, or gelu(h))."""
    if activation == "swiglu":
        assert sg is not None, "act_recompute: SwiGLU needs sg"
        ffn = sg.shape[1]
        _silu_out(h[:, :ffn], out=sg)
        if a is not None:
            torch.mul(sg, h[:, ffn:], out=a)
    elif a is not None:
        _gelu_out(h, out=a)


def act_grad(da: torch.Tensor, h: torch.Tensor, dh: torch.Tensor, sg: torch.Tensor | None, activation: str) -> None:
    """dh [n, I] = d/dh of the activation applied to da [n, F] (overwritten); sg = silu(gate) from
    :func:`act_recompute` (SwiGLU only)."""
    if activation == "swiglu":
        assert sg is not None, "act_grad: SwiGLU needs sg"
        ffn = da.shape[1]
        gate, up = h[:, :ffn], h[:, ffn:]
        # a = silu(g) * u  =>  du = da * silu(g),  dg = silu'(g) * (da * u)
        torch.mul(da, sg, out=dh[:, ffn:])
        da.mul_(up)
        _silu_backward_out(da, gate, grad_input=dh[:, :ffn])
    else:
        _gelu_backward_out(da, h, grad_input=dh)
