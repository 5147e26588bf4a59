"""LM head and cross-entropy fused: the mean next-token loss of ``hidden @ weight^T`` without materialising logits.

Legend: N = tokens (rows), D = hidden, V = vocabulary, c = rows of one chunk.

The plain path computes logits [N, V], keeps them (and their fp32 copy under bf16 autocast) for the backward, runs
``log_softmax`` and its backward over [N, V], and fills an [N, V] zero gradient for ``nll_loss``: at N = 4096,
V = 8192 that is five 128 MiB fp32 passes and about 256 MiB of saved activations. Here the rows run in chunks of
about :data:`CHUNK_ELEMENTS` logits; for each chunk the forward computes the logits, their log-sum-exp, the loss
and right away the gradient of the logits, ``(softmax - onehot(target)) / n``, which it multiplies into the
gradients of ``hidden`` ([c, D]) and ``weight`` ([V, D], accumulated over chunks in fp32). Only those two
gradients are kept; backward scales them by the incoming gradient of the loss. (The same idea as Liger-Kernel's
``FusedLinearCrossEntropy`` and Apple's Cut Cross-Entropy, here on plain PyTorch ops.)

Equal to ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)`` (mean over non-ignored targets; 0 when
there are none, where PyTorch returns NaN): tests/test_perf_fused_ce.py checks the loss and both gradients in fp32,
bf16 autocast and fp64 ``gradcheck``. Softmax and log-sum-exp are computed in fp32 whatever the GEMM dtype.

Cost: the same three GEMMs as the plain path (logits, d hidden, d weight), with the weight-gradient GEMM done in
the forward; the loss is not differentiable twice.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from moetrain.moe.expert_ops import compute_dtype
from moetrain.moe.kernels.cpu.workspace import scratch

IGNORE_INDEX = -100
# Logits per chunk: 4M (16 MiB in fp32), e.g. 512 rows of a 8192-token vocabulary; big enough for efficient GEMMs,
# small enough to stay in the last-level cache.
CHUNK_ELEMENTS = 1 << 22


def _buffer(name: str, h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [c, V] chunk buffer kept between chunks and calls (moe/kernels/cpu/workspace.py): measured in a
    (hidden-256) cpu-small fp32 training step, the logits GEMM took 10-11.5 ms per chunk into a kept buffer against
    12.5-14.5 ms into a fresh one."""
    return scratch("ce." + name, (h.shape[0], weight.shape[0]), dtype, h.device)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # noqa: D102
                chunk_rows: int) -> torch.Tensor:
        n, _ = hidden.shape
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax / lse / weight-gradient accumulator dtype
        valid = targets != IGNORE_INDEX  # [N]
        count = valid.sum()
        scale = 1.0 / count.clamp(min=1).to(acc)  # mean over valid targets
        need_h, need_w = ctx.needs_input_grad[:2]
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        for r0 in range(0, n, chunk_rows):
            h = hidden[r0 : r0 + chunk_rows]  # [c, D]
            t = targets[r0 : r0 + chunk_rows]
            v = valid[r0 : r0 + chunk_rows]
            logits = _buffer("logits", h, weight, acc)  # [c, V] fp32
            if hidden.dtype == acc:
                torch.mm(h, weight.T, out=logits)
            else:  # the GEMM in the low-precision dtype, then widened
                logits.copy_(torch.mm(h, weight.T, out=_buffer("logits_lp", h, weight, hidden.dtype)))
            tc = t.clamp(min=0)[:, None]  # [c, 1]
            picked = logits.gather(1, tc)  # [c, 1] logit of the target
            top = logits.amax(dim=1, keepdim=True)  # [c, 1]
            probs = logits.sub_(top).exp_()  # in place: exp(logit - max), then the softmax
            total = probs.sum(dim=1, keepdim=True)  # [c, 1]
            loss += torch.where(v[:, None], top + total.log() - picked, 0).sum()  # lse - logit[target]
            # d loss / d logits = (softmax - onehot) * scale on valid rows, 0 on ignored ones; in place.
            row_scale = torch.where(v[:, None], scale, 0)  # [c, 1]
            probs.mul_(row_scale / total)
            probs.scatter_add_(1, tc, -row_scale)
            grad = probs if probs.dtype == hidden.dtype else _buffer("grad_lp", h, weight, hidden.dtype).copy_(probs)
            if d_hidden is not None:  # need_h
                torch.mm(grad, weight, out=d_hidden[r0 : r0 + chunk_rows])
            if d_weight is not None:  # need_w
                if grad.dtype == acc:
                    d_weight.addmm_(grad.T, h)
                else:  # low precision: GEMM in bf16 (fp32 accumulation inside), summed over chunks in fp32
                    d_weight.add_(torch.mm(grad.T, h))
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.weight_dtype = weight.dtype
        return loss * scale

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor  # noqa: D102
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        d_hidden, d_weight = ctx.saved_tensors
        dh = d_hidden * grad_loss.to(d_hidden.dtype) if d_hidden is not None else None
        dw = (d_weight * grad_loss).to(ctx.weight_dtype) if d_weight is not None else None
        return dh, dw, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight^T`` against ``targets``, without materialising the logits.

    Args:
        hidden: [N, D] final hidden states (after the final norm).
        weight: [V, D] LM-head weight.
        targets: [N] int64 next-token ids, -100 where no loss is taken.
        chunk_rows: rows per chunk; ``None``: :data:`CHUNK_ELEMENTS` / V.
    Returns:
        scalar fp32 loss (fp64 for fp64 inputs). Under autocast the GEMMs run in the autocast dtype.
    Raises:
        ValueError: mismatched shapes.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or (
            targets.shape != hidden.shape[:1]):
        raise ValueError(f"linear_cross_entropy: shapes do not match: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}, targets {tuple(targets.shape)}")
    dtype = compute_dtype(hidden, weight)  # the autocast dtype under autocast, else the weight's
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        loss = _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]  # Function.apply: untyped in torch
            hidden.to(dtype).contiguous(), weight.to(dtype), targets, rows)
        return cast(torch.Tensor, loss)
