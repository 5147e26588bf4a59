"""Causal grouped-query self-attention with rotary embeddings, optional q/k RMSNorm, a KV cache, and
document-masked attention for packed sequences.

Legend: B = batch, S = new positions, P = cached positions, H = query heads, Hkv = key/value heads, Hd = head size,
D = hidden.

Document masking (``data.packing=documents``): a row holds several documents back to back; ``document_ids`` [B, S]
numbers them (-1 for padding). Query i attends key j only when ``j <= i`` and both belong to the same document, and
rotary positions restart at 0 with every document, so each document's outputs equal those of the document run
alone (tests/test_packing.py). The mask is a block-diagonal causal bool mask [B, 1, S, S] given to
``F.scaled_dot_product_attention``. Why not ``flex_attention`` with a ``BlockMask``: in torch 2.13 it has no CPU
backward ("FlexAttention does not support backward on CPU"), and its CPU forward was slower. Measured 2026-12-01 on
an AMD EPYC (2 shared cores, 1 thread), cpu-small shapes B=16, S=256, H=8, Hkv=4, Hd=32, fp32, 5 documents per row:
SDPA with the bool mask 19.0 ms forward / 59.6 ms forward + backward (plain causal SDPA: 17.0 / 56.7 ms);
flex_attention 195 ms forward eager, 34 ms compiled (after a 16 s compile), no backward (docs/data.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.config import ModelConfig
from moetrain.model.rope import apply_rope, rope_cos_sin, rope_tables


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 with every document of a packed row.

    Args:
        document_ids: [B, S] int64; a new document starts wherever the id differs from the previous position's
            (ids need not be sorted or unique per row beyond that; padding is one more "document").
    Returns:
        [B, S] int64, ``t - start(t)`` where ``start(t)`` is the first position of t's document.
    """
    b, s = document_ids.shape
    t = torch.arange(s, device=document_ids.device).expand(b, s)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_of = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values  # [B, S]
    return t - start_of


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i may attend key j iff ``j <= i`` and both lie in the same document.

    Every query attends at least itself, so no softmax row is empty (padding attends padding, never a document).
    Memory: B * S^2 bytes (1 MiB at B=16, S=256), built once per layer call.
    """
    s = document_ids.shape[1]
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]  # [B, 1, S, S]
    return same & torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()


class KVCache:
    """Keys and values of past positions, per layer, grown by concatenation (generation is not the hot path).

    ``layers[i]`` is ``None`` or ``(k, v)`` with shapes [B, Hkv, P, Hd].
    """

    def __init__(self, n_layers: int):
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers

    def length(self, index: int = 0) -> int:
        """P, the number of positions cached for layer ``index``."""
        past = self.layers[index]
        return 0 if past is None else past[0].shape[2]

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, Hkv, S, Hd] for layer ``index``; return all keys and values [B, Hkv, P + S, Hd]."""
        past = self.layers[index]
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        self.layers[index] = (k, v)
        return k, v


class Attention(nn.Module):
    """Multi-head causal attention computed by ``F.scaled_dot_product_attention`` with GQA.

    ``qk_norm="head"`` applies RMSNorm to each head's q and k before RoPE (Qwen3); ``"full"`` to the whole q and
    k projections (OLMoE). Projection names follow transformers (``q_proj`` ...) for checkpoint interop.
    """

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.n_heads, self.n_kv_heads, self.head_size = config.n_heads, config.n_kv_heads, config.head_size
        self.rope_theta = config.rope_theta
        d, hd = config.hidden, config.head_size
        bias = config.attention_bias  # q/k/v only, as Qwen2's qkv_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm == "head":
            self.q_norm = nn.RMSNorm(hd, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=config.norm_eps)
        elif config.qk_norm == "full":
            self.q_norm = nn.RMSNorm(self.n_heads * hd, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.n_kv_heads * hd, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, S, D] -> [B, S, D]. With ``kv_cache``, the S new positions follow the P cached ones. With
        ``document_ids`` [B, S] int64 (packed documents, see the module docstring) attention stays within each
        document and positions restart per document.

        Raises:
            ValueError: ``document_ids`` together with ``kv_cache`` (generation is one document at a time).
        """
        if document_ids is not None and kv_cache is not None:
            raise ValueError("document_ids: packed documents cannot be combined with a KV cache")
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.n_heads, self.head_size)
        k = k.view(b, s, self.n_kv_heads, self.head_size)
        v = v.view(b, s, self.n_kv_heads, self.head_size).transpose(1, 2)  # [B, Hkv, S, Hd]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, Hd], [B, Hkv, S, Hd]

        past = 0 if kv_cache is None else kv_cache.length(self.layer_index)
        if document_ids is None:
            cos, sin = rope_tables(past, s, self.head_size, self.rope_theta, str(x.device))  # [S, Hd]
        else:
            positions = document_positions(document_ids).reshape(-1)  # [B * S]
            cos, sin = (t.view(b, 1, s, self.head_size)  # [B, 1, S, Hd]: broadcast over heads
                        for t in rope_cos_sin(positions, self.head_size, self.rope_theta))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_index, k, v)  # [B, Hkv, P + S, Hd]

        if document_ids is not None:
            mask = document_causal_mask(document_ids)  # [B, 1, S, S]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        elif past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # New query i (absolute position past + i) sees keys 0 .. past + i.
            mask = torch.ones(s, past + s, dtype=torch.bool, device=x.device).tril(diagonal=past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        y: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_size))
        return y
