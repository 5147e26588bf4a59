"""Configuration of the optimisation loop."""

from __future__ import annotations

import math
import os

from dataclasses import dataclass
from typing import Literal

from moetrain.configlib import require, require_at_least


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimizer, schedule, batching, precision, logging and checkpoint cadence.

    Fields:
        steps: optimizer steps of the whole run (the LR schedule spans these).
        batch_size: sequences per micro-batch.
        grad_accum: micro-batches per optimizer step (global batch = batch_size * grad_accum sequences).
        tokens_per_batch: a token budget per micro-batch instead of ``batch_size`` rows of ``data.seq_len``
            (dynamic batching, needs ``data.packing=documents``): length-bucketed documents, long ones one per
            row, short ones several per row (document-masked), rows x longest row <= this; each micro-batch's
            losses are weighted by its real tokens (train/microbatch_weights.py). 0: off. Must be >=
            ``data.seq_len``.
        lr: peak learning rate (after a linear warm-up of ``warmup_steps``, cosine decay to ``lr * min_lr_ratio``).
        min_lr_ratio: the learning rate at the last step, as a multiple of ``lr``.
        warmup_steps: steps of linear warm-up from 0 to ``lr``.
        router_lr_scale / expert_lr_scale: the learning rate of the MoE routers' gate weights / of the routed
            experts' tensors, as a multiple of ``lr`` (same warm-up and decay; their own AdamW groups, created only
            when a scale is not 1). Fixed for a run (a resume refuses a change).
        weight_decay: AdamW's decoupled weight decay (matrices only, not norms or biases).
        beta1: AdamW's decay rate of the gradient's running mean (first moment).
        beta2: AdamW's decay rate of the squared gradient's running mean (second moment).
        eps: AdamW's denominator epsilon.
        expert_weight_decay: AdamW's decay of the routed experts' tensors alone (not the shared expert's);
            ``None`` (default): ``weight_decay``. A preset may set it (``cpu-small``: 1.0, see docs/moe-vs-dense.md),
            and then ``weight_decay`` alone no longer reaches the experts: set both to change all decay. Fixed
            for a run (a resume refuses a change).
        grad_clip: clip the global gradient norm to this value (0 disables).
        dtype: ``fp32``, or ``bf16`` autocast (the router stays in fp32).
        seed: seeds the weights, the data order and all RNGs.
        deterministic: ``torch.use_deterministic_algorithms`` (exact resume on CPU).
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda``.
        eval_every: steps between validations; 0 disables periodic evaluation.
        eval_batches: micro-batches of the validation split each validation reads (the first ones, in stream
            order: data/val_coverage.py).
        log_every: steps between metrics lines.
        ckpt_every: steps between checkpoints (0: only at the end).
        keep_checkpoints: how many of the newest checkpoints are kept (milestones come on top).
        milestone_every: checkpoints at multiples of this step are never deleted (0: none are kept beyond
            ``keep_checkpoints``).
        optimizer_state: which checkpoints keep the optimizer state (AdamW's two moments per parameter, twice the
            fp32 weights' bytes). ``newest`` (default): once a checkpoint is committed, the older kept ones are
            rewritten without it, crash-safely; they still serve eval / generate / export, and a resume from one
            restarts the moments from zero with a one-line warning (docs/checkpoints.md). ``all``: every checkpoint
            keeps it (any one resumes exactly). Sharded (torchrun, DCP) and object-store checkpoints always keep it.
        checkpoint_url: where checkpoints go: ``None`` = ``RUN_DIR/checkpoints``; an absolute local path or an fsspec
            URL such as ``s3://bucket/prefix`` (needs s3fs; endpoint and credentials from the AWS environment
            variables).
        max_nonfinite_skips: a step with a non-finite loss or gradient norm is skipped (no update); this many
            consecutive skips stop the run with an error after a checkpoint of the last good state.
        threads: ``torch.set_num_threads`` at the start of training; 0 chooses by load: the usable cores less
            those other processes keep busy at the start, at most PyTorch's default (moetrain.runtime.threads); N
            fixes the count (needed for bit-exact resumes).
        time_budget_s: a wall-clock budget in seconds (0: none): the run stops after the step during which this
            process's training loop passed it (the clock starts after the evaluation before training; the periodic
            evaluations and checkpoints on the way count), with a final evaluation and a checkpoint as at
            ``steps``, which stays the upper bound and the length of the LR schedule. A resumed run gets the budget
            again from its resume. Each record of ``metrics.jsonl`` holds the same clock as ``elapsed_s``.
    """

    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    tokens_per_batch: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    router_lr_scale: float = 1.0
    expert_lr_scale: float = 1.0
    weight_decay: float = 0.1
    expert_weight_decay: float | None = None
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: Literal["fp32", "bf16"] = "fp32"
    seed: int = 0
    deterministic: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    milestone_every: int = 0
    optimizer_state: Literal["newest", "all"] = "newest"
    checkpoint_url: str | None = None
    max_nonfinite_skips: int = 5
    threads: int = 0
    time_budget_s: float = 0.0

    def __post_init__(self) -> None:
        require_at_least(self, 1, "steps", "batch_size", "grad_accum", "log_every", "keep_checkpoints", "eval_batches",
                         "max_nonfinite_skips")
        require_at_least(self, 0, "warmup_steps", "eval_every", "ckpt_every", "weight_decay", "grad_clip",
                         "milestone_every", "threads", "tokens_per_batch", "time_budget_s")
        require(math.isfinite(self.weight_decay), "weight_decay", f"must be finite, got {self.weight_decay}")
        if self.expert_weight_decay is not None:
            require(0 <= self.expert_weight_decay < math.inf, "expert_weight_decay",
                    f"must be >= 0 and finite, got {self.expert_weight_decay}")
        for name in ("lr", "router_lr_scale", "expert_lr_scale"):
            value = getattr(self, name)
            require(0 < value < math.inf, name, f"must be > 0 and finite, got {value}")
        require(0 <= self.seed < 2**32, "seed", f"must be in [0, 2**32), got {self.seed}")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        require(0 <= self.beta1 < 1, "beta1", f"must be in [0, 1), got {self.beta1}")
        require(0 <= self.beta2 < 1, "beta2", f"must be in [0, 1), got {self.beta2}")
        if self.milestone_every > 0:  # milestones are kept among the checkpoints written, at ckpt_every's steps
            require(self.ckpt_every > 0 and self.milestone_every % self.ckpt_every == 0, "milestone_every",
                    f"must be a multiple of train.ckpt_every ({self.ckpt_every}), got {self.milestone_every}: "
                    "milestones are kept among the checkpoints written, and no other step has one")
        if self.checkpoint_url is not None:
            require(_known_protocol(self.checkpoint_url), "checkpoint_url",
                    f"unknown storage protocol in {self.checkpoint_url!r}; use a local path or an fsspec URL such as "
                    "s3://bucket/prefix")
            # config.json keeps the value as given: a relative path would find another run's checkpoints, or none,
            # when a later --resume, eval or export starts from another directory
            local = self.checkpoint_url.removeprefix("file://")
            require("://" in local or os.path.isabs(local), "checkpoint_url",
                    f"{self.checkpoint_url!r} is a relative path, which resolves against the directory each command "
                    f"is started from; give an absolute path (e.g. {os.path.abspath(local)!r})")


def _known_protocol(url: str) -> bool:
    """Whether ``url`` is a local path or names a protocol fsspec knows (its package may still be missing)."""
    if "://" not in url:
        return bool(url)
    from fsspec.registry import known_implementations, registry

    protocol = url.split("://", 1)[0]
    return protocol in known_implementations or protocol in registry
