"""Rotary position embeddings (RoFormer, Su et al., 2021), in the "rotate half" layout used by transformers'
Llama / Mixtral / Qwen3 models, so weights interoperate without permutation.

Legend: B = batch, H = heads, S = sequence, Hd = head size, h = Hd / 2.

``rope(x) = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]`` (transformers'
``apply_rotary_pos_emb``). :func:`apply_rope` computes it as one autograd Function on the two halves, ``y1 = x1 c -
x2 s``, ``y2 = x2 c + x1 s`` (the tables' two halves are equal), writing into one output with no temporaries and
saving nothing but the tables; its backward is the inverse rotation, ``dx1 = g1 c + g2 s``, ``dx2 = g2 c - g1 s``.
The composite form (``_rotate_half``, kept as the reference in tests/test_rope.py) builds a negated copy, a
concatenation and two products per call, and its backward the same again.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch.autograd.function import once_differentiable


def rope_cos_sin(positions: torch.Tensor, head_size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions.

    Args:
        positions: [S] int64 absolute positions.
        head_size: Hd (even).
        theta: base.
    Returns:
        (cos, sin), each [S, Hd] fp32.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64, device=positions.device).float() / head_size))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [S, Hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, Hd]
    return emb.cos(), emb.sin()


@functools.lru_cache(maxsize=32)
def rope_tables(start: int, length: int, head_size: int, theta: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cos_sin` for positions ``start .. start + length - 1``, cached (every layer of every step asks
    for the same tables). Returns (cos, sin) [S, Hd] fp32; callers must not modify them."""
    with torch.inference_mode(False), torch.no_grad():  # normal tensors, usable by later training steps
        positions = torch.arange(start, start + length, device=device)
        return rope_cos_sin(positions, head_size, theta)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[x1 c - x2 s, x2 c + x1 s] for x [..., Hd] and half tables c, s [S, h] in x's dtype."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = torch.empty_like(x)
    y1, y2 = out[..., :h], out[..., h:]
    torch.mul(x1, c, out=y1)
    y1.addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=y2)
    y2.addcmul_(x1, s)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(c, s)
        return _rotate(x, c, s)

    @staticmethod
    @once_differentiable  # written with out= kernels: a second derivative raises instead of being wrong
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        c, s = ctx.saved_tensors
        return _rotate(grad, c, -s), None, None  # the inverse rotation


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, Hd]; cos, sin: [S, Hd], or [B, 1, S, Hd] per-sequence positions (packed documents) (fp32,
    halves equal, as :func:`rope_cos_sin` builds them) -> rotated x, same shape and dtype (computed in x's dtype,
    as transformers does)."""
    h = x.shape[-1] // 2
    c, s = cos[..., :h], sin[..., :h]
    if c.dtype != x.dtype:
        c, s = c.to(x.dtype), s.to(x.dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _rotate(x, c, s)  # nothing to differentiate: without the Function's bookkeeping (a decode step's cost)
    rotated = _Rope.apply(x, c, s)  # type: ignore[no-untyped-call]
    return cast(torch.Tensor, rotated)  # Function.apply is untyped in torch's stubs
