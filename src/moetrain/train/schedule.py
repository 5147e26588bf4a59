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


def retarget_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                      config: TrainConfig) -> None:
    """After ``scheduler.load_state_dict`` on resume: follow the schedule ``config`` describes from here on.

    LambdaLR's state holds its position (``last_epoch``, the optimizer steps taken) and the base LR it was built with,
    and the optimizer's state the LR of the next step; both would silently keep the old ``train.lr``. This sets each
    group's base LR to ``config.lr`` times its ``lr_scale`` (train/trainer.py ``build_optimizer``; 1 in checkpoints
    older than the scales) and its next step's LR to ``base * lr_factor(last_epoch, config)``, so a resume
    with a changed ``lr`` / ``warmup_steps`` / ``min_lr_ratio`` / ``steps`` continues on the new curve at the same
    position (with an extended ``steps`` the cosine is stretched over the new total). With an unchanged config this
    recomputes exactly the restored values (the same product LambdaLR computes), so an exact resume stays exact.
    """
    factor = lr_factor(scheduler.last_epoch, config)
    bases = [config.lr * group.get("lr_scale", 1.0) for group in optimizer.param_groups]  # train.*_lr_scale
    scheduler.base_lrs = bases
    for group, base in zip(optimizer.param_groups, bases):
        group["initial_lr"] = base
        group["lr"] = base * factor
    scheduler._last_lr = [base * factor for base in bases]  # what get_last_lr() reports for the next step
