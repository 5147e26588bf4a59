"""Causal grouped-query self-attention with rotary embeddings, optional q/k RMSNorm, a KV cache, and
document-masked attention for packed sequences.

Legend: B = batch, S = new positions, P = cached positions, H = query heads, Hkv = key/value heads, Hd = head size,
D = hidden.

Document masking (``data.packing=documents``): a row holds several documents back to back; ``document_ids`` [B, S]
numbers them (-1 for padding). Query i attends key j only when ``j <= i`` and both belong to the same document, and
rotary positions restart at 0 with every document, so each document's outputs equal those of the document run
alone (tests/test_packing.py). The mask is a block-diagonal causal bool mask [B, 1, S, S] given to
``F.scaled_dot_product_attention``. Why not ``flex_attention`` with a ``BlockMask``: in torch 2.13 it has no CPU
backward ("FlexAttention does not support backward on CPU"), and its CPU forward was slower (docs/data.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    """The KV cache of generation and serving: per layer, one pre-allocated block of ``max_len`` positions for each
    of ``num_slots`` sequences (a sequence owns a slot; ``moetrain generate`` uses slots 0 .. B - 1, the serving
    engine one slot per running request). Blocks, not pages (vLLM, transformers' ``PagedAttentionCache``): why, in
    docs/serving.md.

    The interface :class:`Attention` uses: :meth:`write` stores keys and values where a :class:`RaggedBatch` puts
    its tokens, :meth:`read` returns [b, Hkv, p, Hd] blocks that ``F.scaled_dot_product_attention`` reads directly
    (a view for consecutive slots, a gather otherwise). A layer's block is allocated at its first write, in the
    keys' dtype and device, as zeros (positions past a sequence's length are masked; a masked zero cannot turn into
    NaN).

    Args:
        n_layers: L.
        num_slots: sequences held at once.
        max_len: positions per slot (at most ``model.max_seq_len``).
    Attributes:
        k, v: per layer ``None`` (nothing written yet) or [num_slots, Hkv, max_len, Hd].
        length: positions appended by :meth:`append` (generation: every slot has this many).
    """

    def __init__(self, n_layers: int, num_slots: int, max_len: int):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KVCache: num_slots and max_len must be >= 1, got {num_slots}, {max_len}")
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.num_slots, self.max_len, self.length = num_slots, max_len, 0

    def append(self, batch: int, new: int) -> RaggedBatch:
        """The layout of ``new`` more positions for each of slots 0 .. ``batch - 1`` (generation: every sequence
        at the same length), and count them in :attr:`length`.

        Raises:
            ValueError: more slots than the cache has, or past ``max_len``.
        """
        if batch > self.num_slots or self.length + new > self.max_len:
            raise ValueError(f"KVCache: {batch} sequences x {self.length} + {new} positions exceed the cache's "
                             f"{self.num_slots} slots x {self.max_len} positions")
        layout = RaggedBatch.build([(i, self.length, new) for i in range(batch)])
        self.length += new
        return layout

    def write(self, layer: int, batch: RaggedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, Hkv, Hd] of the batch's N tokens at their (slot, position) in ``layer``."""
        if self.k[layer] is None:
            shape = (self.num_slots, k.shape[1], self.max_len, k.shape[2])
            self.k[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        kc, vc = self.k[layer], self.v[layer]
        assert kc is not None and vc is not None
        if k.dtype != kc.dtype:
            k, v = k.to(kc.dtype), v.to(vc.dtype)
        kc[batch.slots, :, batch.positions] = k
        vc[batch.slots, :, batch.positions] = v

    def read(self, layer: int, slots: slice | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [b, Hkv, length, Hd] of positions 0 .. length - 1 of ``slots`` (b of them)."""
        kc, vc = self.k[layer], self.v[layer]
        assert kc is not None and vc is not None, "KVCache.read before the layer's first write"
        if isinstance(slots, slice):
            return kc[slots, :, :length], vc[slots, :, :length]  # views
        # positions cut first: indexing [slots, :, :length] at once gathered whole slots (max_len positions)
        return kc[:, :, :length].index_select(0, slots), vc[:, :, :length].index_select(0, slots)


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences of a :class:`RaggedBatch` attended in one SDPA call: ``b`` sequences of ``s`` new tokens each.

    Attributes:
        rows: the group's b * s tokens among the batch's N (sequence-major): a slice when contiguous.
        slots: the b sequences' KV-cache slots: a slice when consecutive.
        b, s: sequences, new tokens per sequence.
        keys: key positions read per sequence, ``max(start) + s``.
        mask: [b or 1, 1, s, keys] bool, query i of sequence j sees key positions ``<= start_j + i``; ``None`` when
            every sequence starts at 0 (plain causal attention, keys == s).
    """

    rows: slice | torch.Tensor
    slots: slice | torch.Tensor
    b: int
    s: int
    keys: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class RaggedBatch:
    """A flat batch of N new tokens from B sequences and where they go in a :class:`KVCache` (the layout of
    transformers' continuous batching: cumulative sequence lengths, positions and cache slots per token, the model's
    own modules run over all N tokens at once and attention reads each sequence's keys from its slot).

    Built once per forward by :meth:`build`; every layer reuses it. Sequences of equal new-token counts attend in
    one SDPA call (:class:`AttentionGroup`): all decoding sequences together, prompts of one length together.

    Attributes:
        positions: [N] int64 absolute position of each token (RoPE and the cache index).
        slots: [N] int64 cache slot of each token.
        cu_seqlens: [B + 1] int64 cumulative new-token counts (sequence j's tokens are ``cu[j] .. cu[j + 1] - 1``).
        groups: the SDPA calls of an attention layer.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    _rope: dict[tuple[int, float, str], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(chunks: Sequence[tuple[int, int, int]]) -> RaggedBatch:
        """From (slot, start position, new tokens) per sequence, in token order (no two in one slot).

        Built on the host from Python lists (a serving step builds one for every decoding token): the only tensor
        work is each list's conversion and the masks.

        Raises:
            ValueError: no sequence, or a sequence with no new token.
        """
        if not chunks or min(n for _, _, n in chunks) < 1:
            raise ValueError(f"RaggedBatch: need at least one sequence with at least one new token, got {chunks}")
        offsets = [0, *itertools.accumulate(n for _, _, n in chunks)]  # [B + 1] first token of each sequence
        if len(offsets) - 1 == offsets[-1]:  # one new token per sequence (every decoding step)
            pos = [start for _, start, _ in chunks]
            slot_of = [slot for slot, _, _ in chunks]
        else:
            pos = [p for _, start, n in chunks for p in range(start, start + n)]
            slot_of = [slot for slot, _, n in chunks for _ in range(n)]
        by_len: dict[int, list[int]] = {}
        for j, (_, _, n) in enumerate(chunks):
            by_len.setdefault(n, []).append(j)
        groups = []
        for s, members in by_len.items():
            starts = [chunks[j][1] for j in members]
            rows: slice | torch.Tensor = slice(offsets[members[0]], offsets[members[-1] + 1])
            if members[-1] - members[0] + 1 != len(members):  # not consecutive
                rows = torch.cat([torch.arange(offsets[j], offsets[j + 1]) for j in members])
            slot_list = [chunks[j][0] for j in members]
            slots: slice | torch.Tensor = slice(slot_list[0], slot_list[0] + len(slot_list))
            if slot_list != list(range(slot_list[0], slot_list[0] + len(slot_list))):
                slots = torch.tensor(slot_list)
            keys = max(starts) + s
            mask = None
            if any(starts):
                first = torch.tensor(starts[:1] if starts.count(starts[0]) == len(starts) else starts)  # [b or 1]
                if s == 1:  # decoding sequences: query j sees key positions <= start_j
                    mask = (torch.arange(keys) <= first[:, None])[:, None, None]  # [b or 1, 1, 1, keys]
                else:
                    last = first[:, None] + torch.arange(s)[None, :]  # [b or 1, s] position of each query
                    mask = (torch.arange(keys)[None, None, :] <= last[:, :, None])[:, None]  # [b or 1, 1, s, keys]
            groups.append(AttentionGroup(rows, slots, len(members), s, keys, mask))
        return RaggedBatch(torch.tensor(pos, dtype=torch.int64), torch.tensor(slot_of, dtype=torch.int64),
                           torch.tensor(offsets, dtype=torch.int64), tuple(groups))

    def last_tokens(self) -> torch.Tensor:
        """[B] int64 index of each sequence's last new token among the N."""
        return self.cu_seqlens[1:] - 1

    def rope(self, head_size: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, Hd] fp32 of the tokens' positions (broadcast over heads), computed once per batch."""
        key = (head_size, theta, str(device))
        if key not in self._rope:
            cos, sin = rope_cos_sin(self.positions.to(device), head_size, theta)
            self._rope[key] = (cos[:, None], sin[:, None])
        return self._rope[key]


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
        if config.qk_norm != "none":  # "head": over each head's Hd; "full": over all heads' H * Hd (Hkv * Hd for k)
            full = config.qk_norm == "full"
            self.q_norm = nn.RMSNorm(hd * (self.n_heads if full else 1), eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(hd * (self.n_kv_heads if full else 1), eps=config.norm_eps)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                document_ids: torch.Tensor | None = None, batch: RaggedBatch | None = None) -> torch.Tensor:
        """x: [B, S, D] -> [B, S, D]. With ``document_ids`` [B, S] int64 (packed documents, see the module
        docstring) attention stays within each document and positions restart per document.

        With ``kv_cache`` the tokens are ``batch``'s N (x: [..., D] with N tokens in all, e.g. [B, S, D] from
        :meth:`KVCache.append` or the serving engine's flat [N, D]): their keys and values are written to the cache
        first, then each :class:`AttentionGroup` attends its sequences' cached keys in one SDPA call.

        Raises:
            ValueError: ``document_ids`` together with ``kv_cache`` (generation is one document at a time), or
                ``kv_cache`` without ``batch``.
        """
        if document_ids is not None and kv_cache is not None:
            raise ValueError("document_ids: packed documents cannot be combined with a KV cache")
        if kv_cache is not None:
            if batch is None:
                raise ValueError("batch: a KV cache needs the tokens' RaggedBatch (KVCache.append builds one)")
            return self._forward_cached(x, kv_cache, batch)
        b, s, _ = x.shape
        q, k, v = self._qkv(x)  # [B, S, H, Hd], [B, S, Hkv, Hd] x 2
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, Hd], [B, Hkv, S, Hd]
        if document_ids is None:
            cos, sin = rope_tables(0, s, self.head_size, self.rope_theta, str(x.device))  # [S, Hd]
        else:
            positions = document_positions(document_ids).reshape(-1)  # [B * S]
            cos, sin = (t.view(b, 1, s, self.head_size)  # [B, 1, S, Hd]: broadcast over heads
                        for t in rope_cos_sin(positions, self.head_size, self.rope_theta))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None if document_ids is None else document_causal_mask(document_ids)  # [B, 1, S, S]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        y: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_size))
        return y

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., D] -> q [..., H, Hd], k and v [..., Hkv, Hd]: the projections and the q/k norms, before RoPE."""
        lead = x.shape[:-1]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(*lead, self.n_heads, self.head_size)
        k = k.view(*lead, self.n_kv_heads, self.head_size)
        v = v.view(*lead, self.n_kv_heads, self.head_size)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _forward_cached(self, x: torch.Tensor, cache: KVCache, batch: RaggedBatch) -> torch.Tensor:
        """The ragged-batch path: x [..., D] holding the batch's N tokens -> the same shape."""
        shape = x.shape
        q, k, v = self._qkv(x.reshape(-1, shape[-1]))  # [N, H, Hd], [N, Hkv, Hd] x 2
        n, hq, hd = q.shape
        cos, sin = batch.rope(hd, self.rope_theta, x.device)  # [N, 1, Hd]
        # q and k rotated in one call (the same elementwise maths; one call's overhead less per layer and step)
        qk = apply_rope(torch.cat((q, k), dim=1), cos, sin)  # [N, H + Hkv, Hd]
        q, k = qk[:, :hq], qk[:, hq:]
        cache.write(self.layer_index, batch, k, v)
        if len(batch.groups) == 1:  # one SDPA call over all N tokens in order (a decoding step): no scatter
            out = self._attend_group(q, cache, batch.groups[0])
        else:
            out = q.new_empty(n, hq, hd)
            for g in batch.groups:
                out[g.rows] = self._attend_group(q[g.rows], cache, g)
        y: torch.Tensor = self.o_proj(out.view(n, hq * hd))
        return y.view(shape)

    def _attend_group(self, q: torch.Tensor, cache: KVCache, g: AttentionGroup) -> torch.Tensor:
        """q [b * s, H, Hd] of one :class:`AttentionGroup`'s tokens -> attention output [b * s, H, Hd]."""
        hq, hd = q.shape[1], q.shape[2]
        keys, values = cache.read(self.layer_index, g.slots, g.keys)  # [b, Hkv, P, Hd]
        qg = q.view(g.b, g.s, hq, hd).transpose(1, 2)  # [b, H, s, Hd]
        mask = g.mask if g.mask is None or g.mask.device == q.device else g.mask.to(q.device)  # built on the host
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask,
                                           is_causal=mask is None, enable_gqa=True)  # [b, H, s, Hd]
        return o.transpose(1, 2).reshape(g.b * g.s, hq, hd)
