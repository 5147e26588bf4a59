"""RMSNorm (Zhang & Sennrich, 2019) with a hand-written backward that saves only the input and 1 / rms.

``y = x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 (a bf16 input is upcast, the output cast back), as
``torch.nn.RMSNorm`` and transformers' ``MixtralRMSNorm`` / ``LlamaRMSNorm``. The parameter is named ``weight``,
so state dicts are interchangeable with ``nn.RMSNorm``.

Why not ``nn.RMSNorm``: on CPU it runs as a chain of autograd ops that together save the input, ``x * rstd`` and
``rstd`` (2 D + 1 elements per token in fp32, measured with ``saved_tensors_hooks``), and backward walks that chain
op by op. This Function saves ``x`` (held by the caller anyway: the residual stream) and ``rstd`` (1 per token)
and recomputes ``x * rstd`` in backward: D elements per token less for every norm, which is what BTA's memory
balance (docs/bta.md) and activation memory in general are made of.

Backward (``r = rstd``, ``gw = dL/dy * weight``):
    dL/dx = r * gw - x * r^3 * mean(gw * x)
    dL/dweight = sum over tokens of dL/dy * x * r
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.function import once_differentiable


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward: (y [..., D] in x's dtype, rstd [..., 1] fp32 (fp64 for fp64))."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x if x.dtype == acc else x.to(acc)  # the dtype compared first: a no-op .to costs a dispatch (decode steps)
    squares = torch.matmul(xf.unsqueeze(-2), xf.unsqueeze(-1)).squeeze(-1)  # [..., 1] sum of x^2 over D
    rstd = squares.div_(x.shape[-1]).add_(eps).rsqrt_()  # [..., 1] fp32 (fp64 for fp64), in the product's memory
    y = torch.mul(xf, rstd)
    y.mul_(weight if weight.dtype == acc else weight.to(acc))
    return (y if y.dtype == x.dtype else y.to(x.dtype)), rstd


class _RMSNormFunction(torch.autograd.Function):
    # Fewer passes over [..., D] than the formulas written out op by op (measured on CPU, [16, 256, 256] fp32, forward
    # + backward: 2.6 ms vs 6.9 ms): the row reductions run as batched dot products (matmul), the output and dx are
    # built in place, and mean(gw * xhat) comes from the same product that gives dweight.
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: D102
        y, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable  # a second derivative raises instead of being silently wrong
    def backward(ctx: Any, grad: torch.Tensor  # noqa: D102
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        acc, d = rstd.dtype, x.shape[-1]
        xhat = x.to(acc) * rstd  # recomputed [..., D]
        gf = grad.to(acc)
        wf = weight.to(acc)
        prod = gf * xhat  # [..., D] dL/dy * xhat
        dx: torch.Tensor | None = None
        dw: torch.Tensor | None = None
        if ctx.needs_input_grad[1]:
            dw = prod.reshape(-1, d).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            mean = torch.matmul(prod, wf).unsqueeze(-1) / d  # [..., 1] mean(gw * xhat), gw = dL/dy * weight
            gw = gf.mul_(wf) if gf is not grad else gf * wf  # in place unless gf is the incoming gradient itself
            dx = gw.addcmul_(xhat, mean, value=-1).mul_(rstd).to(x.dtype)  # rstd * (gw - xhat * mean)
        return dx, dw, None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned scale, fp32 internals.

    Args:
        dim: D, the normalised (last) dimension.
        eps: added to the mean square.
    Shapes:
        x: [..., D] fp32 or bf16 -> same shape and dtype.
    Source: the formula of ``torch.nn.RMSNorm`` / transformers' ``LlamaRMSNorm`` (equal within fp32 rounding,
    tests/test_norm.py); the backward is derived in the module docstring.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast the norm runs in fp32 regardless (as nn.RMSNorm, on autocast's fp32 list).
        device = x.device.type
        if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
            with torch.autocast(device_type=device, enabled=False):
                return self._norm(x)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            y = _RMSNormFunction.apply(x, self.weight, self.eps)  # type: ignore[no-untyped-call]
            return cast(torch.Tensor, y)  # Function.apply is untyped in torch's stubs
        # Nothing to differentiate (generation, serving, evaluation): the same forward without the autograd
        # Function's bookkeeping, which costs more than the norm itself on a decode step's few tokens.
        return _rms_norm(x, self.weight, self.eps)[0]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """LayerNorm (Ba et al., 2016) over the last dim with a learned scale and bias: ``model.norm=layernorm``.

    ``y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` (biased variance), in fp32 (a bf16 input is upcast,
    the output cast back; ``layer_norm`` is on autocast's fp32 list as well). Parameters ``weight`` and ``bias`` [D]
    (start at 1 and 0; no weight decay, being 1-D), so state dicts are ``torch.nn.LayerNorm``'s.

    Why offer it beside RMSNorm (it also removes each hidden vector's mean, which RMSNorm lets through to the router
    and the attention, and its bias is an offset RMSNorm cannot express; one more reduction per token, D more
    parameters per norm) and its measured effect: docs/data.md. The Hugging Face MoE families we export (Mixtral,
    Qwen2/3-MoE, OLMoE, dots.llm1) all use RMSNorm, so exporting it is refused naming ``model.norm``.

    Shapes:
        x: [..., D] fp32 or bf16 -> same shape and dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        no_autocast = (torch.autocast(device_type=x.device.type, enabled=False) if x.device.type in ("cpu", "cuda")
                       else contextlib.nullcontext())
        with no_autocast:
            acc = torch.promote_types(x.dtype, torch.float32)
            y = torch.nn.functional.layer_norm(x.to(acc), self.normalized_shape, self.weight.to(acc),
                                               self.bias.to(acc), self.eps)
            return y.to(x.dtype)


NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}
"""``model.norm`` value -> the norm class (constructor ``(dim, eps)``)."""


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """The ``model.norm`` norm over D = ``dim``.

    Raises:
        ValueError: an unknown ``kind`` (the config refuses it first, naming ``model.norm``).
    """
    if kind not in NORMS:
        raise ValueError(f"model.norm: must be one of {sorted(NORMS)}, got {kind!r}")
    return NORMS[kind](dim, eps=eps)
