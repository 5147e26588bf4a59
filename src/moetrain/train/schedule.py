"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""

from __future__ import annotations

import math

import torch

from moetrain.train.config import TrainConfig


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of ``config.lr`` for optimizer step ``step`` (0-based).

    ``(step + 1) / warmup`` during warm-up; then ``min + (1 - min) * (1 + cos(pi * progress)) / 2`` with progress
    going 0 -> 1 from the end of warm-up to ``config.steps``; constant ``min_lr_ratio`` after ``steps``.
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    lo = config.min_lr_ratio
    return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
