"""Step-level load balancing: the aux-loss-free expert-bias update and the hook that makes counts global.

Legend: L = MoE layers, E = experts.

Both mechanisms need the expert counts of a whole optimizer step, summed over its micro-batches and over the
data-parallel ranks. Model code stays single-device: whoever runs data parallelism passes a
:data:`CountReducer` (e.g. an all-reduce over the DP group) to ``moetrain.train.step.train_step`` (or to
``MoETransformer.forward``), and nothing here knows about process groups.
"""

from __future__ import annotations

from typing import Callable

import torch

CountReducer = Callable[[torch.Tensor], torch.Tensor]
"""Sums an [L, E] fp32 count tensor over the data-parallel ranks and returns the sum (the same on every rank).

Example: ``def reduce(t): torch.distributed.all_reduce(t, group=dp_group); return t``. It is a collective: every
rank must call it at the same point (the trainer calls it once per step, before the first backward when the
global-batch aux loss is on, and once after the optimizer step when an expert bias is on).
"""


def expert_bias_delta(counts: torch.Tensor, rate: float) -> torch.Tensor:
    """The aux-loss-free bias update ``rate * sign(mean(counts) - counts)``.

    Under-loaded experts (count below the mean) gain ``rate``, over-loaded ones lose it, exactly balanced ones stay
    (Wang et al., 2024, "Auxiliary-Loss-Free Load Balancing", Algorithm 1; DeepSeek-V3 sec. 2.1.2; Megatron-Core
    ``get_updated_expert_bias``).

    Args:
        counts: [E] (or [..., E]) assignments per expert over one optimizer step (all micro-batches and ranks).
        rate: the update speed u (DeepSeek-V3: 0.001).
    Returns:
        [E] fp32 delta to add to the bias.
    """
    counts = counts.float()
    return rate * torch.sign(counts.mean(dim=-1, keepdim=True) - counts)

