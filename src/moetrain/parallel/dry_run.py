"""``moetrain train --dry-run --world-size N``: validate a config and lay it out for N ranks without a process
group, data or memory (the model is built on the meta device). What it checks (:func:`check`, each failure one line
naming the field) and prints (:func:`dry_run`): docs/expert-parallel.md and docs/scale-out.md, Planning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moetrain.data.loader import check_packing
from moetrain.errors import ConfigError
from moetrain.parallel.layout import Layout
from moetrain.parallel.pipeline import V_SCHEDULES, check_losses, rank_stages, stage_blocks

if TYPE_CHECKING:
    from moetrain.config import Config


@dataclass
class DryRun:
    """The result. ``rank_bytes``: parameters + gradients + AdamW state of the busiest rank (bytes, from the meta
    model); ``planner_bytes``: the same from ``moetrain.analysis.params.sharded_params``."""

    layout: Layout
    stages: list[range]
    rank_bytes: float
    planner_bytes: float
    lines: list[str]


def check(config: Config, world: int) -> tuple[Layout, list[range]]:
    """The layout and pipeline stages of ``config`` on ``world`` ranks.

    Raises:
        ConfigError: an impossible layout (names the field and values).
    """
    p, m, t = config.parallel, config.model, config.train
    layout = Layout.from_config(p, world)
    stages = stage_blocks(m, layout.pp * p.pp_stages_per_rank, config.data.seq_len, p.activation_checkpoint)
    if layout.pp > 1 and m.tie_embeddings and p.pp_schedule in V_SCHEDULES:
        raise ConfigError(f"model.tie_embeddings: parallel.pp_schedule='{p.pp_schedule}' places the embedding and "
                          "the LM head on the same rank in two stages, which cannot share a weight; set it to false "
                          "or use pp_schedule 1f1b, interleaved_1f1b or gpipe")
    if layout.pp > 1:
        check_losses(m)
    check_packing(config.data.packing, world)
    if t.batch_size % layout.data_parallel:
        raise ConfigError(f"train.batch_size: {t.batch_size} sequences per micro-batch do not split over the "
                          f"{layout.data_parallel} data-parallel ranks per stage (dp_replicate x dp_shard x ep)")
    from moetrain.parallel.pipeline_runner import check_microbatches

    check_microbatches(p, t.grad_accum)
    local = t.batch_size // layout.data_parallel
    tiles = m.execution.bta_tiles
    if local % tiles:
        raise ConfigError(f"model.execution.bta_tiles: {tiles} tiles do not divide the {local} sequences each rank "
                          f"computes per micro-batch (train.batch_size / {layout.data_parallel} ranks)")
    return layout, stages


def dry_run(config: Config, world: int) -> DryRun:
    """Validate and lay out ``config`` for ``world`` ranks: the mesh, the stages with their blocks, the busiest
    rank's bytes of parameters + gradients + AdamW state from the meta model's shapes (with FSDP2's row padding)
    next to the planner's figure, each pipeline rank's memory (:mod:`.memory`) and the AdamW groups as the trainer
    builds them (:func:`optimizer_lines`).

    Raises:
        ConfigError: see :func:`check`.
    """
    from moetrain.analysis.params import count_params, placements, sharded_params
    from moetrain.analysis.shape import ModelShape
    from moetrain.parallel.meta_init import build_meta
    from moetrain.runtime.preflight import human_bytes

    layout, stages = check(config, world)
    from moetrain.parallel.memory import STATE_BYTES, memory_lines, rank_memory

    model = build_meta(config.model)  # shapes only: no memory
    ranks = rank_memory(config, world, model)
    per_rank = max(r.state for r in ranks)
    held = [rank_stages(r, layout.pp, config.parallel.pp_stages_per_rank, config.parallel.pp_schedule)
            for r in range(layout.pp)]
    shape = ModelShape.from_config(config.model)
    planner = STATE_BYTES * sharded_params(count_params(shape), shape.n_layers, layout.ep, layout.pp,
                                           layout.dp_shard, placements(stages, held))
    lines = [layout.describe(),
             "stages: " + ", ".join(f"{i}: blocks {b.start}-{b.stop - 1}" + (" + embedding" if i == 0 else "")
                                    + (" + norm + LM head" if i == len(stages) - 1 else "")
                                    for i, b in enumerate(stages)),
             f"per rank: {human_bytes(per_rank)} of fp32 parameters + gradients + AdamW state "
             f"({per_rank // STATE_BYTES:,.0f} parameters; planner: {human_bytes(planner)})",
             *memory_lines(config, world, ranks=ranks), *optimizer_lines(model, config)]
    return DryRun(layout, stages, per_rank, planner, lines)


def optimizer_lines(model: torch.nn.Module, config: Config) -> list[str]:
    """One line per AdamW group of ``model`` (any device, meta included) as the trainer builds it: its role,
    tensors, parameters, peak learning rate (``train.lr`` x its scale; the schedule's warm-up and decay multiply
    it) and weight decay; after a header line."""
    from moetrain.train.param_groups import param_groups

    lr = config.train.lr
    groups = param_groups(model.named_parameters(), config)
    lines = [f"optimizer: AdamW, {len(groups)} parameter groups (whole model; train.lr={lr!r})"]
    for g in groups:
        scale = "" if g.lr_scale == 1 else f" ({g.lr_scale!r} x train.lr)"
        lines.append(f"  {g.role}: {len(g.params)} tensors, {g.numel:,} parameters, lr {lr * g.lr_scale:g}{scale}, "
                     f"weight decay {g.weight_decay!r}")
    return lines


def too_large(config: Config, world: int, device_type: str, free_bytes: float) -> str | None:
    """Why ``config`` cannot train on ``world`` ranks of this machine, or ``None`` when its sharded training state
    fits: the per-rank bytes of parameters + gradients + AdamW state (:func:`dry_run`) against ``free_bytes``, and
    the smallest layout the planner finds for such devices (``moetrain plan``'s defaults: 1024 sequences of 4096
    tokens, or the model's context if shorter, bf16).

    Raises:
        ConfigError: an impossible layout (:func:`check`).
    """
    from moetrain.analysis.hardware import get_hardware
    from moetrain.analysis.planner import smallest_fitting
    from moetrain.analysis.shape import ModelShape

    run = dry_run(config, world)
    if run.rank_bytes <= free_bytes:
        return None
    hw_name = "cpu" if device_type == "cpu" else "h100"
    m = config.model
    seq = min(4096, m.max_seq_len)
    found = smallest_fitting(ModelShape.from_config(m), [m.is_moe_layer(i) for i in range(m.n_layers)],
                             get_hardware(hw_name), seq, 1024)
    if found is None:
        fit = f"no layout of up to 4096 {hw_name} devices fits"
    else:
        n, result = found
        best = result.recommended
        assert best is not None and best.best is not None  # smallest_fitting returns plans with a fitting pick
        fit = (f"the smallest layout that fits is {n} {hw_name} devices as {best.layout.label} "
               f"({best.best.memory / 1e9:.1f} GB/device with activations); write its config with `moetrain plan "
               f"--preset {config.preset} --devices {n} --device {hw_name} --emit FILE.toml`")
    return (f"preset {config.preset}: needs {run.rank_bytes / 1e9:.1f} GB per rank for fp32 parameters + gradients + "
            f"AdamW state on {world} rank(s) ({run.layout.describe().split(';')[0]}), this machine has "
            f"{free_bytes / 1e9:.1f} GB free; {fit}")
