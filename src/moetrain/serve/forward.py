"""One continuous-batching step of the model over a ragged batch: every running sequence's new tokens (a whole
prompt for a sequence being prefilled, one token for a decoding one) in one flat batch.

Legend: N = tokens of the step, B = sequences of the step, D = hidden, H = query heads, Hkv = key/value heads,
Hd = head size, P = cached positions, V = vocabulary.

Everything but attention runs once over all N tokens (projections, norms, MoE layers with their routing policy,
dense FFNs), which is where batching pays; attention reads each sequence's own keys from its KV-cache slot:
decoding sequences together in one SDPA call (keys padded to the longest, masked), prefilling ones one call each
(causal). The weights are the model's own modules; the math is :class:`moetrain.model.attention.Attention` and
:class:`moetrain.model.block.Block` step for step, so greedy outputs equal ``moetrain generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetrain.model.rope import apply_rope, rope_cos_sin
from moetrain.serve.kv_cache import SlotKVCache
from moetrain.serve.moe import MoEStepStats, StepPolicies, experts_forward, serve_moe


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a step: ``length`` new tokens at positions ``start ..`` of KV-cache ``slot``."""

    slot: int
    start: int
    length: int


@dataclass(frozen=True)
class StepBatch:
    """The flat batch of a step (sequences' tokens contiguous, in ``chunks`` order).

    Attributes:
        input_ids / slots / positions: [N] int64.
        chunks: one :class:`SeqChunk` per sequence.
    """

    input_ids: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    chunks: tuple[SeqChunk, ...]

    @staticmethod
    def build(seqs: list[tuple[int, int, list[int]]]) -> StepBatch:
        """From (slot, start position, new token ids) per sequence."""
        ids: list[int] = []
        slots: list[int] = []
        pos: list[int] = []
        chunks: list[SeqChunk] = []
        for slot, start, toks in seqs:
            ids += toks
            slots += [slot] * len(toks)
            pos += range(start, start + len(toks))
            chunks.append(SeqChunk(slot, start, len(toks)))
        as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return StepBatch(as_t(ids), as_t(slots), as_t(pos), tuple(chunks))


class StepRunner:
    """Runs :meth:`step` for one model and one :class:`SlotKVCache`.

    Args:
        model: a :class:`~moetrain.model.transformer.MoETransformer` in eval mode.
        cache: the slots' KV cache (built for this model).
        int8_routers: block index -> :class:`~moetrain.serve.routing.Int8Router` replacing that MoE layer's
            fp32 router weight; empty = fp32 routers.
        experts_fn: the routed-experts computation (see :func:`moetrain.serve.moe.serve_moe`).
    """

    def __init__(self, model, cache: SlotKVCache, int8_routers: dict | None = None, experts_fn=experts_forward):
        self.model, self.cache = model, cache
        self.int8_routers = int8_routers or {}
        self.experts_fn = experts_fn
        cfg = model.config
        self.cos, self.sin = rope_cos_sin(torch.arange(cfg.max_seq_len), cfg.head_size, cfg.rope_theta)  # [P, Hd]

    @torch.inference_mode()
    def step(self, batch: StepBatch, policies: StepPolicies, all_logits: bool = False
             ) -> tuple[torch.Tensor, list[MoEStepStats]]:
        """Run the step's N tokens; returns (logits [B, V] fp32 at each sequence's last new token, or [N, V] at
        every token with ``all_logits`` (evaluation), and one :class:`MoEStepStats` per MoE block)."""
        model = self.model
        x = model.embed_tokens(batch.input_ids)  # [N, D]
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]  # [N, Hd]
        stats: list[MoEStepStats] = []
        for i, block in enumerate(model.blocks):
            h = x + self._attention(i, block.attn, block.input_norm(x), batch, cos, sin)
            if block.is_moe:
                y, s = serve_moe(block.ffn, block.post_attn_norm(h), policies, self.int8_routers.get(i),
                                 self.experts_fn)
                stats.append(s)
            else:
                y = block.ffn(block.post_attn_norm(h))
            x = h + y
        if not all_logits:
            x = x[torch.tensor([c.length for c in batch.chunks]).cumsum(0) - 1]  # [B, D] last token of each
        return model.lm_head(model.norm(x)).float(), stats

    def _attention(self, layer: int, attn, x: torch.Tensor, batch: StepBatch, cos: torch.Tensor, sin: torch.Tensor
                   ) -> torch.Tensor:
        """x: [N, D] normed -> [N, D]; writes the step's keys and values into the cache first."""
        n, hq, hkv, hd = x.shape[0], attn.n_heads, attn.n_kv_heads, attn.head_size
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if attn.qk_norm == "full":
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.view(n, hq, hd), k.view(n, hkv, hd), v.view(n, hkv, hd)
        if attn.qk_norm == "head":
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rope(q.transpose(0, 1)[None], cos, sin)[0]  # [H, N, Hd]
        k = apply_rope(k.transpose(0, 1)[None], cos, sin)[0]  # [Hkv, N, Hd]
        self.cache.write(layer, batch.slots, batch.positions, k.transpose(0, 1), v)
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # [slots, Hkv, P, Hd]
        out = torch.empty(n, hq, hd, dtype=q.dtype)
        offsets = [0]
        for c in batch.chunks:
            offsets.append(offsets[-1] + c.length)
        decode = [j for j, c in enumerate(batch.chunks) if c.length == 1]
        if decode:  # one SDPA call for all single-token sequences: keys padded to the longest, masked
            idx = torch.tensor([offsets[j] for j in decode])
            slots = torch.tensor([batch.chunks[j].slot for j in decode])
            lens = torch.tensor([batch.chunks[j].start + 1 for j in decode])  # [Bd] keys each query sees
            p = int(lens.max())
            mask = (torch.arange(p)[None, :] < lens[:, None])[:, None, None, :]  # [Bd, 1, 1, P]
            o = F.scaled_dot_product_attention(q[:, idx].transpose(0, 1)[:, :, None], kc[slots, :, :p],
                                               vc[slots, :, :p], attn_mask=mask, enable_gqa=True)  # [Bd, H, 1, Hd]
            out[idx] = o[:, :, 0]
        for j, c in enumerate(batch.chunks):
            if c.length == 1:
                continue
            a, b = offsets[j], offsets[j + 1]
            qs = q[:, a:b][None]  # [1, H, S, Hd]
            ks, vs = kc[c.slot:c.slot + 1, :, :c.start + c.length], vc[c.slot:c.slot + 1, :, :c.start + c.length]
            if c.start == 0:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:  # new query i (position start + i) sees keys 0 .. start + i
                m = torch.ones(c.length, c.start + c.length, dtype=torch.bool).tril(diagonal=c.start)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, enable_gqa=True)
            out[a:b] = o[0].transpose(0, 1)
        return attn.o_proj(out.reshape(n, hq * hd))
