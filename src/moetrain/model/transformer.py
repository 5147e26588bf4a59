"""The decoder-only MoE language model: embedding -> blocks -> norm -> LM head, with the training loss.

Legend: B = batch, S = sequence, D = hidden, V = vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.attention import KVCache, RaggedBatch
from moetrain.model.block import Block
from moetrain.model.config import ModelConfig
from moetrain.model.fused_ce import IGNORE_INDEX, linear_cross_entropy
from moetrain.model.norm import make_norm
from moetrain.moe.balancing import CountReducer
from moetrain.moe.config import MoEConfig
from moetrain.moe.layer import MoEAux, MoELayer
from moetrain.moe.losses import global_load_balancing_loss, pooled_load_balancing_loss
from moetrain.moe.weight_init import deferred_init
from moetrain.runtime.cpu import bf16_autocast_is_slow


@dataclass
class ModelOutput:
    """Result of :meth:`MoETransformer.forward`. Every MoE loss is unweighted, averaged over MoE layers, and 0 for a
    dense model; ``moe_loss`` holds their weighted sum (coefficients from ``config.moe.losses``).

    Attributes:
        logits: [B, S, V] in the compute dtype; ``None`` after ``forward(..., return_logits=False)``.
        loss: scalar fp32 ``lm_loss + moe_loss`` (``None`` without targets).
        lm_loss: scalar fp32 mean cross-entropy over targets != -100 (``None`` without targets).
        aux_loss, seq_aux_loss, z_loss, util_loss, entropy_loss: the layers' :class:`MoEAux` losses of those names
            (Switch, sequence-level, z-loss, utilisation, gate-output smoothing), averaged over layers.
        pooled_aux_loss: transformers' ``load_balancing_loss_func`` pooled over layers (balanced = K).
        global_aux_loss: Switch loss with the step's global counts (balanced = 1.0).
        moe_loss: scalar fp32 sum of ``<name>_coeff`` * loss over the terms above (:data:`MOE_LOSS_TERMS`).
        moe: one :class:`MoEAux` per MoE block, in block order.
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    pooled_aux_loss: torch.Tensor | None = None
    seq_aux_loss: torch.Tensor | None = None
    global_aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    util_loss: torch.Tensor | None = None
    entropy_loss: torch.Tensor | None = None
    moe_loss: torch.Tensor | None = None
    moe: list[MoEAux] = field(default_factory=list)


MOE_LOSS_TERMS = ("aux_loss", "pooled_aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss", "util_loss",
                  "entropy_loss")
"""The MoE loss fields of :class:`ModelOutput`; each is weighted by ``config.moe.losses.<name>_coeff``."""


def assemble_moe_losses(
    out: ModelOutput,
    config: MoEConfig,
    global_counts: torch.Tensor | None = None,
    count_reducer: CountReducer | None = None,
    device: torch.device | None = None,
) -> None:
    """Fill ``out``'s MoE loss fields from its per-layer records ``out.moe``.

    Gradient accumulation (``grad_accum`` micro-batches of equal token counts, each loss divided by
    ``grad_accum``): the z-loss, sequence-level and global-batch losses then give exactly the gradients of one
    large batch; the Switch, pooled and utilisation losses are non-linear in the batch and are averaged over
    micro-batches (as Megatron-Core and transformers do).

    Args:
        out: the model output with ``moe`` set; its loss fields are overwritten.
        config: the MoE config (its ``losses`` coefficients).
        global_counts: [L, E] the optimizer step's assignment counts per MoE layer, summed over all
            micro-batches and data-parallel ranks (``MoETransformer.moe_counts``); ``None``: this micro-batch's.
        count_reducer: sums [L, E] counts over data-parallel ranks; used (in training with gradients) on this
            micro-batch's counts when ``global_counts`` is ``None`` and the global-batch loss is on.
        device: where the losses live; ``None``: the logits' device.
    """
    records = out.moe
    if device is None:
        assert out.logits is not None, "assemble_moe_losses: pass device= when the output has no logits"
        device = out.logits.device
    zero = torch.zeros((), device=device)
    if not records:
        for name in MOE_LOSS_TERMS:
            setattr(out, name, zero)
        out.moe_loss = zero
        return
    counts = torch.stack([r.tokens_per_expert for r in records])  # [L, E]
    prob_sums = torch.stack([r.prob_sum for r in records])  # [L, E]
    num_tokens = torch.stack([r.num_tokens for r in records])  # [L]
    for name in ("aux_loss", "seq_aux_loss", "z_loss", "util_loss"):  # per-layer losses: the mean over layers
        setattr(out, name, torch.stack([getattr(r, name) for r in records]).mean())
    out.pooled_aux_loss = pooled_load_balancing_loss(counts, prob_sums, num_tokens)
    out.entropy_loss = torch.stack([zero if r.entropy_loss is None else r.entropy_loss for r in records]).mean()
    if global_counts is None:
        global_counts = counts
        if count_reducer is not None and config.losses.global_aux_loss_coeff > 0 and torch.is_grad_enabled():
            global_counts = count_reducer(counts.clone())
    out.global_aux_loss = torch.stack([
        global_load_balancing_loss(prob_sums[i], num_tokens[i], global_counts[i].to(device))
        for i in range(len(records))
    ]).mean()
    # Only the terms with a positive coefficient: a 0 * term would still backpropagate (zeros) through its graph.
    weighted = [getattr(config.losses, f"{name}_coeff") * getattr(out, name) for name in MOE_LOSS_TERMS
                if getattr(config.losses, f"{name}_coeff") > 0]
    out.moe_loss = torch.stack(weighted).sum() if weighted else zero


class MoETransformer(nn.Module):
    """Mixtral / Qwen3-MoE-style decoder. Build on ``torch.device("meta")`` to count parameters without memory."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden)
        with deferred_init():  # reset_parameters draws the MoE weights below, in one order (moe/weight_init.py)
            self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = make_norm(config.norm, config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for every matrix; output projections (attention ``o_proj``, FFN ``down_proj``) use
        ``init_std / sqrt(2 * n_layers)`` (GPT-2's residual scaling); norms start at 1, biases at 0."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        global_counts: torch.Tensor | None = None,
        count_reducer: CountReducer | None = None,
        return_logits: bool = True,
        document_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Args:
            input_ids: [B, S] int64.
            targets: [B, S] int64 next-token ids, -100 where no loss is taken; ``None`` skips the loss.
            padding_mask: [B, S] bool, True for real tokens (excluded tokens do not count in the MoE losses).
            kv_cache: past keys/values for generation: the B rows go to the cache's slots 0 .. B - 1 at positions
                ``kv_cache.length ..`` (:meth:`~moetrain.model.attention.KVCache.append`).
            global_counts: [L, E] the optimizer step's expert counts for the global-batch aux loss (see
                :func:`assemble_moe_losses` and :meth:`moe_counts`); ``None``: this batch's own.
            count_reducer: sums counts over data-parallel ranks (see :func:`assemble_moe_losses`).
            return_logits: with ``False`` and ``targets``, the LM head and the cross-entropy run fused, chunk by
                chunk, without materialising [B, S, V] logits (model/fused_ce.py: same loss and gradients, less
                time and memory); ``out.logits`` is then ``None``.
            document_ids: [B, S] int64, packed documents (``data.packing=documents``): attention stays within
                each document and positions restart per document (model/attention.py); ``None``: one sequence
                per row.

        Under a caller's bf16 autocast on a CPU without fast bf16 GEMMs (no AVX512_BF16 / AMX), the model runs in
        fp32 instead (100x faster there; :func:`moetrain.runtime.cpu.bf16_autocast_is_slow`, ``MOETRAIN_BF16``).
        """
        if bf16_autocast_is_slow(input_ids.device.type):
            with torch.autocast("cpu", enabled=False):
                return self.forward(input_ids, targets, padding_mask, kv_cache, global_counts, count_reducer,
                                    return_logits, document_ids)
        batch = None if kv_cache is None else kv_cache.append(*input_ids.shape)
        x, records = self.run_blocks(self.embed(input_ids), None, padding_mask, kv_cache, document_ids, batch)
        fused_loss = targets is not None and not return_logits
        logits = None if fused_loss else self.logits(x)  # [B, S, V]
        out = ModelOutput(logits=logits, moe=records)
        assemble_moe_losses(out, self.config.moe, global_counts, count_reducer, device=x.device)
        if targets is not None:
            if logits is None:  # fused_loss
                h = self.norm(x)  # [B, S, D]
                lm_loss = linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm_head.weight, targets.reshape(-1))
            else:
                lm_loss = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
                )
            assert out.moe_loss is not None  # assemble_moe_losses set it
            out.lm_loss = lm_loss
            out.loss = lm_loss + out.moe_loss
        return out

    # The three steps of the forward, public so that a pipeline stage (parallel/pipeline.py) runs its slice of the
    # model through this code: the first stage embeds, every stage runs its own blocks, the last one has the head.

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] int64 token ids -> [B, S, D] embeddings, then dropout (``config.dropout``) in training.

        The embedding module's own train / eval mode decides the dropout: a pipeline stage calls this on the whole
        model while only the stage's modules follow the stage's ``train()`` / ``eval()``."""
        x: torch.Tensor = self.embed_tokens(input_ids)  # [B, S, D]
        if self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, self.embed_tokens.training)
        return x

    def run_blocks(
        self, x: torch.Tensor, blocks: Iterable[nn.Module] | None = None, padding_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None, document_ids: torch.Tensor | None = None, batch: RaggedBatch | None = None,
    ) -> tuple[torch.Tensor, list[MoEAux]]:
        """Hidden states through transformer blocks, in order.

        Args:
            x: [B, S, D] hidden states (the embeddings, or a previous pipeline stage's output).
            blocks: the :class:`Block` modules to run (a pipeline stage's own, in global order); ``None``: all of
                the model's.
            padding_mask: [B, S] bool, as in :meth:`forward`.
            kv_cache: past keys/values, as in :meth:`forward`.
            document_ids: [B, S] int64, as in :meth:`forward`.
            batch: where the tokens go in ``kv_cache`` (``kv_cache.append``).
        Returns:
            ([B, S, D] hidden states, one :class:`MoEAux` per MoE block run, in block order).
        """
        records: list[MoEAux] = []
        for block in self.blocks if blocks is None else blocks:
            x, aux = block(x, padding_mask, kv_cache, document_ids, batch=batch)
            if aux is not None:
                records.append(aux)
        return x, records

    def logits(self, x: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """[B, S, D] output of the last block -> [B, S, V] logits: the final norm, then the LM head.

        Args:
            x: [B, S, D] hidden states.
            lm_head: the head to apply; ``None``: the model's own. A pipeline's last stage passes its copy of a
                tied embedding (:class:`~moetrain.parallel.pipeline.StageModule`).
        """
        head = self.lm_head if lm_head is None else lm_head
        return cast(torch.Tensor, head(self.norm(x)))

    @torch.no_grad()
    def moe_counts(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The routing pass of the global-batch aux loss: [L, E] fp32 expert counts (selection, real tokens) of
        every MoE layer for ``input_ids`` [B, S], without gradients and without the LM head.

        It runs the embedding and all blocks (later layers route on earlier layers' outputs), i.e. about one
        forward pass: with gradient accumulation this adds roughly a third to the step's compute. Call it in the
        same mode (train / eval) and RNG state as the pass it prepares, so that both route identically.
        """
        _, records = self.run_blocks(self.embed(input_ids), padding_mask=padding_mask, document_ids=document_ids)
        if not records:
            return torch.zeros(0, self.config.moe.num_experts, device=input_ids.device)
        return torch.stack([r.tokens_per_expert for r in records])

    def moe_layers(self) -> list[MoELayer]:
        return [cast(MoELayer, b.ffn) for b in self.blocks if b.is_moe]  # is_moe: the block's ffn is a MoELayer


def count_parameters(model: MoETransformer) -> tuple[int, int]:
    """(total, active) parameter counts; active counts only ``top_k`` of each MoE layer's ``num_experts`` routed
    experts (embeddings and the LM head count once each, tied weights once). Works on the meta device."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for layer in model.moe_layers():
        e, k = layer.config.num_experts, layer.config.top_k
        expert_params = sum(p.numel() for p in layer.experts.parameters())
        inactive += expert_params * (e - k) // e
    return total, total - inactive
