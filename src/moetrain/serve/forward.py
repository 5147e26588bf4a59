"""One continuous-batching step of the model over a ragged batch: every running sequence's new tokens (a whole
prompt for a sequence being prefilled, one token for a decoding one) in one flat batch.

Legend: N = tokens of the step, B = sequences of the step, D = hidden, V = vocabulary.

The step runs the model's own blocks over the N tokens (:meth:`moetrain.model.block.Block.forward` with the
engine's :class:`~moetrain.model.attention.KVCache` and the step's
:class:`~moetrain.model.attention.RaggedBatch`): projections, norms, MoE layers and dense FFNs once over all N
tokens, which is where batching pays, and attention reading each sequence's own keys from its cache slot (all
decoding sequences in one SDPA call). The routing policies enter as the MoE layers' routing hook
(:class:`~moetrain.serve.moe.StepRouting`), int8 / paged experts as their expert provider. There is no second
forward: greedy outputs equal ``moetrain generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.model.attention import KVCache, RaggedBatch
from moetrain.moe.layer import ExpertProvider
from moetrain.serve.moe import MoEStepStats, StepPolicies, StepRouting


@dataclass(frozen=True)
class StepBatch:
    """The flat batch of a step: ``input_ids`` [N] int64, the sequences' new tokens contiguous, in the order given
    to :meth:`build`; ``layout`` where they go in the KV cache (positions, slots, attention groups)."""

    input_ids: torch.Tensor
    layout: RaggedBatch

    @staticmethod
    def build(seqs: list[tuple[int, int, list[int]]]) -> StepBatch:
        """From (slot, start position, new token ids) per sequence."""
        ids = torch.tensor([t for _, _, toks in seqs for t in toks], dtype=torch.int64)
        return StepBatch(ids, RaggedBatch.build([(slot, start, len(toks)) for slot, start, toks in seqs]))


class StepRunner:
    """Runs :meth:`step` for one model and one KV cache.

    Args:
        model: a :class:`~moetrain.model.transformer.MoETransformer` in eval mode.
        cache: the slots' :class:`~moetrain.model.attention.KVCache` (one slot per running sequence).
        int8_routers: block index -> :class:`~moetrain.serve.routing.Int8Router` replacing that MoE layer's
            fp32 router weight; empty = fp32 routers.
        experts_fn: an :data:`~moetrain.moe.layer.ExpertProvider` for every MoE layer during this runner's steps
            (int8 experts, the hot/cold expert store); ``None`` = the layers' own experts.
    """

    def __init__(self, model, cache: KVCache, int8_routers: dict | None = None,
                 experts_fn: ExpertProvider | None = None):
        self.model, self.cache, self.experts_fn = model, cache, experts_fn
        self.int8_routers = int8_routers or {}
        self._int8_by_layer = {model.blocks[i].ffn: r for i, r in self.int8_routers.items()}

    @torch.inference_mode()
    def step(self, batch: StepBatch, policies: StepPolicies, all_logits: bool = False
             ) -> tuple[torch.Tensor, list[MoEStepStats]]:
        """Run the step's N tokens; returns (logits [B, V] fp32 at each sequence's last new token, or [N, V] at
        every token with ``all_logits`` (evaluation), and one :class:`MoEStepStats` per MoE block)."""
        model, routing = self.model, StepRouting(policies, self._int8_by_layer)
        # this runner's experts for this step only (the model may serve other runners)
        swapped = [(layer, layer.expert_provider) for layer in model.moe_layers()
                   if layer.expert_provider is not self.experts_fn]
        for layer, _ in swapped:
            layer.set_expert_provider(self.experts_fn)
        try:
            x = model.embed_tokens(batch.input_ids)  # [N, D]
            for block in model.blocks:
                x, _ = block(x, kv_cache=self.cache, batch=batch.layout, routing=routing)
        finally:
            for layer, provider in swapped:
                layer.set_expert_provider(provider)
        if not all_logits and batch.layout.cu_seqlens.numel() - 1 < x.shape[0]:  # else each token is a last one
            x = x[batch.layout.last_tokens()]  # [B, D] last token of each sequence
        return model.lm_head(model.norm(x)).float(), routing.stats
