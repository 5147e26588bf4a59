"""Rotary position embeddings (RoFormer, Su et al., 2021), in the "rotate half" layout used by transformers'
Llama / Mixtral / Qwen3 models, so weights interoperate without permutation.

Legend: B = batch, H = heads, S = sequence, Hd = head size.
"""

from __future__ import annotations

import torch


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, Hd]; cos, sin: [S, Hd] -> rotated x, same shape and dtype."""
    return (x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)).to(x.dtype)
