"""One optimizer step: gradient accumulation over micro-batches, clipping, AdamW, LR schedule, expert-bias update.

Each micro-batch's loss is divided by ``grad_accum`` (or weighted by its real tokens: train/microbatch_weights.py),
which is exact for every token-mean term. The global-batch aux loss first runs a no-grad routing pre-pass
(:meth:`MoETransformer.moe_counts`, about one extra forward) for the whole step's counts, summed over data-parallel
ranks by a :data:`~moetrain.moe.balancing.CountReducer`; the losses that are not linear in the batch are averaged
over micro-batches (docs/routing.md, "Balancing losses"). The aux-loss-free expert bias is updated once per
optimizer step, after the optimizer, from the counts of all micro-batches (and ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import torch

from moetrain.data.batch import Batch, model_inputs, to_device
from moetrain.model.transformer import MOE_LOSS_TERMS, MoETransformer
from moetrain.moe.balancing import CountReducer
from moetrain.moe.layer import MoELayer
from moetrain.train.config import TrainConfig
from moetrain.train.microbatch_weights import batch_moe_counts, micro_batch_weights, scaled, step_loss, term_share


def autocast_context(device: torch.device, dtype: str) -> AbstractContextManager[Any]:
    """bf16 autocast for ``dtype == "bf16"``, else a no-op. The router opts out of it (see moe/router.py). On a CPU
    without fast bf16 GEMMs (no AVX512_BF16 / AMX) bf16 computes in fp32 instead: a no-op too
    (:func:`moetrain.runtime.cpu.bf16_compute`; the trainer says so once at start)."""
    from moetrain.runtime.cpu import bf16_compute

    if dtype == "bf16" and bf16_compute(device):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


@dataclass
class StepResult:
    """What one optimizer step reports. Tensors stay on device (reading them is a host sync).

    Attributes:
        lm_loss: scalar, mean LM loss over the step's tokens.
        grad_norm: scalar, global gradient norm before clipping.
        lr: learning rate used by this step.
        tokens_per_expert: one [E] fp32 tensor per MoE layer, summed over the step's micro-batches.
        skipped: the loss or the gradient norm was not finite, so no update was made (parameters, optimizer
            state, expert biases and LR schedule unchanged; gradients discarded).
        moe_losses: every MoE loss term of ``ModelOutput`` (``aux_loss``, ``pooled_aux_loss``, ``seq_aux_loss``,
            ``global_aux_loss``, ``z_loss``, ``util_loss``, ``moe_loss``), averaged over micro-batches.
    """

    lm_loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    tokens_per_expert: list[torch.Tensor] = field(default_factory=list)
    skipped: bool = False
    moe_losses: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Accumulated:
    """What :func:`accumulate_gradients` returns (detached, on device).

    Attributes:
        lm_loss: scalar mean LM loss over the micro-batches.
        moe_losses: MoE loss terms averaged over micro-batches (names as in ``ModelOutput``).
        tokens_per_expert: [L, E] selection counts summed over micro-batches.
        global_counts: [L, E] the counts of the pre-pass after the reducer (``None`` when no pre-pass ran).
    """

    lm_loss: torch.Tensor
    moe_losses: dict[str, torch.Tensor]
    tokens_per_expert: torch.Tensor
    global_counts: torch.Tensor | None = None


# The MoE loss terms of ``ModelOutput`` (the model owns the list) and their weighted sum, as a step reports them.
_STEP_MOE_TERMS = (*MOE_LOSS_TERMS, "moe_loss")


def accumulate_gradients(
    model: MoETransformer,
    batches: Sequence[Batch],
    dtype: str,
    device: torch.device,
    count_reducer: CountReducer | None = None,
    grad_sync: Callable[[bool], None] | None = None,
) -> Accumulated:
    """Forward and backward every micro-batch, each loss divided by ``len(batches)`` (or, for token-budget
    :class:`~moetrain.data.batch.PackedBatch` micro-batches, weighted by its share of the step's real tokens:
    train/microbatch_weights.py); gradients accumulate in ``.grad`` (the caller zeroes them).

    Args:
        model: the model, in training mode.
        batches: micro-batches (inputs, targets) [B, S] int64, all of the same shape; or PackedBatch micro-batches
            of any shapes.
        dtype: ``fp32`` or ``bf16`` (autocast).
        device: where to compute.
        count_reducer: sums [L, E] counts over data-parallel ranks (a collective), or ``None`` on one rank.
        grad_sync: called before each micro-batch's forward with whether it is the step's last: data parallelism
            reduces the accumulated gradients over the ranks once, in the last backward; ``None`` on one rank.
    """
    g = len(batches)
    batches = [to_device(b, device) for b in batches]
    weights = micro_batch_weights(batches)
    global_counts: torch.Tensor | None = None
    # The routing pre-pass: the global-batch aux loss is on and the step spans several micro-batches or ranks.
    pre_pass = model.config.moe.losses.global_aux_loss_coeff > 0 and (g > 1 or count_reducer is not None)
    if pre_pass and model.moe_layers():
        # Same mode and the same random numbers (router jitter) as the passes below, so they route identically.
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), autocast_context(device, dtype):
            # a tensor: there is at least one micro-batch
            global_counts = cast(torch.Tensor, sum(batch_moe_counts(model, b) for b in batches))
        if count_reducer is not None:
            global_counts = count_reducer(global_counts)
    zero = torch.zeros((), device=device)
    lm = zero.clone()
    losses = {name: zero.clone() for name in _STEP_MOE_TERMS}
    counts: torch.Tensor | None = None
    for i, batch in enumerate(batches):
        inputs, targets, batch_kwargs = model_inputs(batch)  # + padding_mask, document_ids of a PackedBatch
        if grad_sync is not None:
            grad_sync(i == g - 1)
        with autocast_context(device, dtype):
            out = model(inputs, targets, **batch_kwargs, global_counts=global_counts,
                        count_reducer=count_reducer if global_counts is None else None,
                        return_logits=False)  # fused LM head + loss: no [B, S, V] logits (model/fused_ce.py)
        step_loss(model, out, weights, i, g).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        lm += scaled(out.lm_loss.detach(), weights, i, g)
        for name in _STEP_MOE_TERMS:
            losses[name] += term_share(model, out, name, weights, i, g)
        if out.moe:
            c = torch.stack([r.tokens_per_expert for r in out.moe])
            counts = c if counts is None else counts + c
    if counts is None:  # no MoE layer
        counts = torch.zeros(0, model.config.moe.num_experts, device=device)
    return Accumulated(lm_loss=lm, moe_losses=losses, tokens_per_expert=counts, global_counts=global_counts)


def finish_step(
    acc: Accumulated,
    layers: Sequence[MoELayer],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: TrainConfig,
    clip: Callable[[float], torch.Tensor],
    count_reducer: CountReducer | None = None,
    reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StepResult:
    """Everything after the micro-batches' backward, for every layout (one process, data / expert parallel, a
    pipeline rank): the losses averaged over ranks, clipping, the non-finite check, AdamW and the LR schedule, then
    the expert-bias update.

    Args:
        acc: the step's losses and counts (:func:`accumulate_gradients`, or a pipeline schedule's).
        layers: the MoE layers whose counts ``acc`` holds, in order (their expert biases are updated).
        clip: clips the gradients to the given max norm and returns the global norm (a scalar tensor) before
            clipping; under data parallelism it also makes them the global batch's where backward did not.
        count_reducer: sums [L, E] counts over the data-parallel ranks (for the expert-bias update when no pre-pass
            counted the step); ``None`` on one rank.
        reduce_mean: the mean over data-parallel ranks of a 1-D tensor of this rank's losses, so that every rank
            reports, and decides to skip a non-finite step on, the same values; ``None`` on one rank.
    """
    if reduce_mean is not None:
        names = list(acc.moe_losses)
        means = reduce_mean(torch.stack([acc.lm_loss, *acc.moe_losses.values()]))
        acc.lm_loss, acc.moe_losses = means[0], dict(zip(names, means[1:]))
    lm, aux, z = acc.lm_loss, acc.moe_losses["aux_loss"], acc.moe_losses["z_loss"]
    grad_norm = clip(config.grad_clip if config.grad_clip > 0 else float("inf"))
    lr = float(scheduler.get_last_lr()[0])  # a float already (LambdaLR)
    result = StepResult(lm_loss=lm, grad_norm=grad_norm, lr=lr,
                        tokens_per_expert=list(acc.tokens_per_expert.unbind(0)), moe_losses=acc.moe_losses)
    # A non-finite loss or gradient would poison the weights and AdamW's moments for good: skip the update and
    # leave the schedule where it is (as Megatron-LM does). Costs one host sync per step (the trainer reads the
    # loss every step anyway). A non-finite gradient makes the norm non-finite, so the norm covers all of them.
    checked = torch.stack([lm, aux, z, acc.moe_losses["moe_loss"], grad_norm.to(lm.dtype)])
    if not bool(torch.isfinite(checked).all()):
        optimizer.zero_grad(set_to_none=True)
        result.skipped = True
        return result
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if any(layer.router.e_score_correction_bias is not None for layer in layers):
        step_counts = acc.global_counts
        if step_counts is None:
            step_counts = acc.tokens_per_expert
            if count_reducer is not None:
                step_counts = count_reducer(step_counts.clone())
        for layer, counts in zip(layers, step_counts):  # [E] of each layer, all micro-batches and ranks
            if layer.router.e_score_correction_bias is not None:
                layer.router.update_expert_bias(counts)
    return result


def train_step(
    model: MoETransformer,
    next_batch: Callable[[], Batch],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: TrainConfig,
    device: torch.device,
    count_reducer: CountReducer | None = None,
    sync_grads: Callable[[float], torch.Tensor] | None = None,
    reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    grad_sync: Callable[[bool], None] | None = None,
) -> StepResult:
    """Run ``config.grad_accum`` micro-batches from ``next_batch()`` (inputs, targets [B, S] int64), then
    :func:`finish_step` (clip, step the optimizer and scheduler, update the expert biases).

    Args:
        count_reducer: data parallelism only: sums [L, E] expert counts over the DP ranks (for the global-batch aux
            loss and the expert-bias update); ``None`` on a single rank.
        sync_grads: data / expert parallelism only: turns this rank's gradients into the global batch's where
            backward did not, clips them to the given max norm and returns the global norm
            (:meth:`moetrain.parallel.launch.ParallelHooks.sync_grads`); ``None``: ``clip_grad_norm_`` here.
        reduce_mean: data parallelism only: the mean over ranks of a 1-D tensor of this rank's losses.
        grad_sync: data parallelism only: :func:`accumulate_gradients`'s ``grad_sync``.
    """
    batches = [next_batch() for _ in range(config.grad_accum)]
    acc = accumulate_gradients(model, batches, config.dtype, device, count_reducer, grad_sync)

    def clip(max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    return finish_step(acc, model.moe_layers(), optimizer, scheduler, config, sync_grads or clip, count_reducer,
                       reduce_mean)
