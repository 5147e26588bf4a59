"""One pre-norm transformer block: ``x + attn(norm(x))``, then ``h + ffn(norm(h))`` with a dense or MoE FFN."""

from __future__ import annotations

import torch
from torch import nn

from moetrain.model.attention import Attention, KVCache
from moetrain.model.config import ModelConfig
from moetrain.model.ffn import SwiGLU
from moetrain.moe.layer import MoEAux, MoELayer


class Block(nn.Module):
    """Legend: B = batch, S = sequence, D = hidden. ``is_moe`` follows the config's layer plan."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.is_moe = config.is_moe_layer(index)
        self.input_norm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.attn = Attention(config, index)
        self.post_attn_norm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.ffn: nn.Module = MoELayer(config.hidden, config.moe) if self.is_moe else SwiGLU(config.hidden, config.ffn_hidden)

    def forward(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None
    ) -> tuple[torch.Tensor, MoEAux | None]:
        """x: [B, S, D] -> ([B, S, D], the MoE record or ``None`` for a dense block)."""
        h = x + self.attn(self.input_norm(x), kv_cache)
        if self.is_moe:
            y, aux = self.ffn(self.post_attn_norm(h), padding_mask)
            return h + y, aux
        return h + self.ffn(self.post_attn_norm(h)), None
