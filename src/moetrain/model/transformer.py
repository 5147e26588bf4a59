"""The decoder-only MoE language model: embedding -> blocks -> RMSNorm -> LM head, with the training loss.

Legend: B = batch, S = sequence, D = hidden, V = vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.attention import KVCache
from moetrain.model.block import Block
from moetrain.model.config import ModelConfig
from moetrain.moe.layer import MoEAux, MoELayer

IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    """Result of :meth:`MoETransformer.forward`.

    Attributes:
        logits: [B, S, V] in the compute dtype.
        loss: scalar fp32 ``lm_loss + aux_loss_coeff * aux_loss + z_loss_coeff * z_loss`` (``None`` without targets).
        lm_loss: scalar fp32 mean cross-entropy over targets != -100 (``None`` without targets).
        aux_loss: scalar fp32 Switch loss averaged over MoE layers (balanced = 1.0; 0 for a dense model).
        z_loss: scalar fp32 router z-loss averaged over MoE layers.
        moe: one :class:`MoEAux` per MoE block, in block order.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    moe: list[MoEAux] = field(default_factory=list)


class MoETransformer(nn.Module):
    """Mixtral / Qwen3-MoE-style decoder. Build on ``torch.device("meta")`` to count parameters without memory."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for every matrix; output projections (attention ``o_proj``, FFN ``down_proj``) use
        ``init_std / sqrt(2 * n_layers)`` (GPT-2's residual scaling); norms start at 1."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
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
    ) -> ModelOutput:
        """Args:
            input_ids: [B, S] int64.
            targets: [B, S] int64 next-token ids, -100 where no loss is taken; ``None`` skips the loss.
            padding_mask: [B, S] bool, True for real tokens (excluded tokens do not count in the aux losses).
            kv_cache: past keys/values for generation (positions continue after the cached ones).
        """
        x = self.embed_tokens(input_ids)  # [B, S, D]
        records: list[MoEAux] = []
        for block in self.blocks:
            x, aux = block(x, padding_mask, kv_cache)
            if aux is not None:
                records.append(aux)
        logits = self.lm_head(self.norm(x))  # [B, S, V]
        out = ModelOutput(logits=logits, moe=records)
        zero = torch.zeros((), device=x.device)
        out.aux_loss = torch.stack([r.aux_loss for r in records]).mean() if records else zero
        out.z_loss = torch.stack([r.z_loss for r in records]).mean() if records else zero
        if targets is not None:
            out.lm_loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
            )
            moe = self.config.moe
            out.loss = out.lm_loss + moe.aux_loss_coeff * out.aux_loss + moe.z_loss_coeff * out.z_loss
        return out

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if b.is_moe]


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
