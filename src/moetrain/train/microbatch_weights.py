"""Weights that make gradient accumulation over micro-batches of different token counts equal one large batch.

Legend: g = micro-batches of the step, n_i = real (non-padding) tokens of micro-batch i, N = sum n_i, r_i = rows
of micro-batch i holding at least one real token, R = sum r_i.

With token-budget micro-batches (``train.tokens_per_batch``) each micro-batch's loss is weighted by ``n_i / N`` and
the sequence-level aux loss by ``r_i / R`` (which terms this makes exact: docs/data.md, "Dynamic batching"). With
plain ``(inputs, targets)`` micro-batches of equal shape the weights are ``None`` and the step divides by g.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moetrain.data.batch import Batch, PackedBatch, model_inputs, real_tokens
from moetrain.model.transformer import ModelOutput, MoETransformer

_SEQUENCE_TERMS = frozenset({"seq_aux_loss"})
"""The :data:`~moetrain.model.transformer.MOE_LOSS_TERMS` that are means over sequences, not tokens."""


@dataclass(frozen=True)
class MicroBatchWeights:
    """Per-micro-batch weights of one optimizer step.

    Fields:
        tokens: [g] ``n_i / N`` (sum to 1).
        rows: [g] ``r_i / R`` (sum to 1).
    """

    tokens: tuple[float, ...]
    rows: tuple[float, ...]


def micro_batch_weights(batches: Sequence[Batch]) -> MicroBatchWeights | None:
    """The weights of ``batches``; ``None`` when none is a :class:`PackedBatch` (equal plain micro-batches: 1 / g).

    One host sync per micro-batch (the counts), before the first forward.
    """
    if not any(isinstance(b, PackedBatch) for b in batches):
        return None
    n = [float(real_tokens(b)) for b in batches]
    r = [float(b.real_rows) if isinstance(b, PackedBatch) else float(b[1].shape[0]) for b in batches]
    total_n, total_r = max(sum(n), 1.0), max(sum(r), 1.0)
    return MicroBatchWeights(tuple(x / total_n for x in n), tuple(x / total_r for x in r))


def scaled(value: torch.Tensor, weights: MicroBatchWeights | None, i: int, g: int, term: str = "lm_loss"
           ) -> torch.Tensor:
    """``value`` (micro-batch i's mean of ``term``) times its share of the step: ``/ g`` without weights, else
    ``* rows[i]`` for a sequence-mean term and ``* tokens[i]`` for every other."""
    if weights is None:
        return value / g
    return value * (weights.rows[i] if term in _SEQUENCE_TERMS else weights.tokens[i])


def term_share(model: MoETransformer, out: ModelOutput, name: str, weights: MicroBatchWeights | None, i: int,
               g: int) -> torch.Tensor:
    """Micro-batch i's share of the reported term ``name`` of ``out`` (detached): :func:`scaled`, and for
    ``moe_loss`` the same split as :func:`step_loss` (its sequence-level part by row weight)."""
    value: torch.Tensor = getattr(out, name).detach()
    if name != "moe_loss" or weights is None:
        return scaled(value, weights, i, g, name)
    assert out.lm_loss is not None  # a forward with targets
    return step_loss(model, out, weights, i, g).detach() - out.lm_loss.detach() * weights.tokens[i]


def step_loss(model: MoETransformer, out: ModelOutput, weights: MicroBatchWeights | None, i: int, g: int
              ) -> torch.Tensor:
    """Micro-batch i's share of the step's loss, to backward: ``out.loss / g`` without weights; else
    ``tokens[i] * out.loss`` with the sequence-level aux loss moved to its row weight (its coefficient read from
    ``model.config.moe.losses``)."""
    assert out.loss is not None  # a forward with targets
    if weights is None:
        return out.loss / g
    loss = out.loss * weights.tokens[i]
    coeff = model.config.moe.losses.seq_aux_loss_coeff
    if coeff:
        assert out.seq_aux_loss is not None  # assemble_moe_losses sets every term
        loss = loss + coeff * out.seq_aux_loss * (weights.rows[i] - weights.tokens[i])
    return loss


def batch_moe_counts(model: MoETransformer, batch: Batch) -> torch.Tensor:
    """``model.moe_counts`` of ``batch`` (the global-batch pre-pass): [L, E] fp32, real tokens only."""
    inputs, _, kwargs = model_inputs(batch)
    return model.moe_counts(inputs, **kwargs)
