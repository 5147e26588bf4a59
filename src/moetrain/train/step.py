"""One optimizer step: gradient accumulation over micro-batches, clipping, AdamW, LR schedule.

Every micro-batch has the same number of tokens, so dividing each micro-batch's mean loss by ``grad_accum`` gives
exactly the mean over the whole step for the token-mean terms (LM loss, z-loss); the per-micro-batch Switch loss is
averaged over micro-batches (it is not linear in the batch, so this differs slightly from one large batch).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from moetrain.model.transformer import MoETransformer
from moetrain.train.config import TrainConfig


def autocast_context(device: torch.device, dtype: str):
    """bf16 autocast for ``dtype == "bf16"``, else a no-op. The router opts out of it (see moe/router.py)."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


@dataclass
class StepResult:
    """What one optimizer step reports. Tensors stay on device (reading them is a host sync).

    Attributes:
        lm_loss: scalar, mean LM loss over the step's tokens.
        aux_loss: scalar, Switch loss averaged over MoE layers and micro-batches (unweighted).
        z_loss: scalar, router z-loss averaged likewise (unweighted).
        grad_norm: scalar, global gradient norm before clipping.
        lr: learning rate used by this step.
        tokens_per_expert: one [E] fp32 tensor per MoE layer, summed over the step's micro-batches.
    """

    lm_loss: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    tokens_per_expert: list[torch.Tensor] = field(default_factory=list)


def train_step(
    model: MoETransformer,
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: TrainConfig,
    device: torch.device,
) -> StepResult:
    """Run ``config.grad_accum`` micro-batches from ``next_batch()`` (inputs, targets [B, S] int64), then clip and
    step the optimizer and scheduler."""
    zero = torch.zeros((), device=device)
    lm, aux, z = zero.clone(), zero.clone(), zero.clone()
    counts: list[torch.Tensor] = []
    for _ in range(config.grad_accum):
        inputs, targets = next_batch()
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast_context(device, config.dtype):
            out = model(inputs, targets)
        (out.loss / config.grad_accum).backward()
        lm += out.lm_loss.detach() / config.grad_accum
        aux += out.aux_loss.detach() / config.grad_accum
        z += out.z_loss.detach() / config.grad_accum
        layer_counts = [r.tokens_per_expert for r in out.moe]
        counts = layer_counts if not counts else [a + b for a, b in zip(counts, layer_counts)]
    max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(lm_loss=lm, aux_loss=aux, z_loss=z, grad_norm=grad_norm, lr=lr, tokens_per_expert=counts)
