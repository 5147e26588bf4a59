"""One pre-norm transformer block: ``x + attn(norm(x))``, then ``h + ffn(norm(h))`` with a dense or MoE FFN.

With ``bta_tiles = G > 1`` the norm + attention run over G tiles of the batch (Batch Tiling on Attention, see
model/bta.py) and the FFN / MoE once over all tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moetrain.model.attention import Attention, KVCache, RaggedBatch
from moetrain.model.bta import tiled_attention
from moetrain.model.config import ModelConfig
from moetrain.model.ffn import SwiGLU
from moetrain.model.norm import make_norm
from moetrain.moe.layer import MoEAux, MoELayer, RoutingHook


class Block(nn.Module):
    """Legend: B = batch, S = sequence, D = hidden. ``is_moe`` follows the config's layer plan; ``bta_tiles`` is
    the config's G (attention tiles per micro-batch, 1 = untiled)."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.is_moe = config.is_moe_layer(index)
        self.bta_tiles = config.execution.bta_tiles
        self.dropout = config.dropout
        self.input_norm = make_norm(config.norm, config.hidden, config.norm_eps)
        self.attn = Attention(config, index)
        self.post_attn_norm = make_norm(config.norm, config.hidden, config.norm_eps)
        self.ffn: nn.Module = (MoELayer(config.hidden, config.moe, config.execution) if self.is_moe
                               else SwiGLU(config.hidden, config.ffn_hidden))

    def forward(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None, *, batch: RaggedBatch | None = None,
        routing: RoutingHook | None = None,
    ) -> tuple[torch.Tensor, MoEAux | None]:
        """x: [B, S, D] -> ([B, S, D], the MoE record or ``None`` for a dense block or under ``routing``).
        ``document_ids`` [B, S] int64: packed documents, attention stays within each (model/attention.py).
        ``kv_cache`` with ``batch``: x holds the batch's N tokens (any leading shape, e.g. the serving engine's flat
        [N, D]) and attention reads the cache (:meth:`Attention.forward`). ``routing``: the MoE layer's inference
        routing (:meth:`MoELayer.forward`).

        Raises:
            ConfigError: ``bta_tiles`` does not divide B (training only; generation with a KV cache never tiles).
        """
        if kv_cache is None or document_ids is not None:  # untiled when bta_tiles == 1
            h = x + self._dropout(tiled_attention(self.attend, x, self.bta_tiles, document_ids))
        else:
            h = x + self._dropout(self.attend(x, None, kv_cache, batch))
        if self.is_moe:
            y, aux = self.ffn(self.post_attn_norm(h), padding_mask, routing=routing)
            return h + self._dropout(y), aux
        return h + self._dropout(self.ffn(self.post_attn_norm(h))), None

    def _dropout(self, y: torch.Tensor) -> torch.Tensor:
        """Residual dropout (``model.dropout``) of a branch's output; the identity in eval mode or at 0."""
        return F.dropout(y, self.dropout, self.training) if self.dropout > 0 else y

    def attend(self, x: torch.Tensor, document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None,
               batch: RaggedBatch | None = None) -> torch.Tensor:
        """The attention branch ``attn(input_norm(x))``: [b, S, D] -> [b, S, D] (what BTA tiles and recomputes);
        ``document_ids`` [b, S] int64 for packed documents."""
        y: torch.Tensor = self.attn(self.input_norm(x), kv_cache, document_ids, batch)
        return y
