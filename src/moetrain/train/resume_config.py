"""Which config fields a resumed run may change (``moetrain train --out RUN --resume FIELD=VALUE``; the rules and
why: docs/checkpoints.md, "Resuming: what may change").

A checkpoint fixes the model, the data and the optimizer's AdamW settings and batching: a change to one of those is
refused, naming the field, the run's value and the new one. The rest may change and takes effect.
"""

from __future__ import annotations

from typing import Any

from moetrain.config import Config
from moetrain.configlib import format_value
from moetrain.errors import ConfigError

# Fields under model.* / data.* that do not change what was trained: the execution choices, which change neither the
# maths nor the weights (tested equal: backends, recomputed experts, BTA tiles), and where the data cache lives. A
# resumed run may switch them, e.g. to fit memory.
# data.workers / data.prefetch only choose which process builds the batches, never which batches (data/loader.py).
CHANGEABLE_MODEL_DATA = {"data.cache_dir", "data.workers", "data.prefetch"}
CHANGEABLE_PREFIX = "model.execution."
# The lr scales and the experts' decay decide the AdamW groups.
FIXED_TRAIN = {"batch_size", "grad_accum", "tokens_per_batch", "seed", "weight_decay", "beta1", "beta2", "eps",
               "checkpoint_url", "router_lr_scale", "expert_lr_scale", "expert_weight_decay"}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def is_fixed(path: str) -> bool:
    """Whether the field ``path`` (``model.hidden``) must keep its value when a run is resumed."""
    if path == "preset":
        return True
    if path.startswith(CHANGEABLE_PREFIX):
        return False
    if path.startswith(("model.", "data.")):
        return path not in CHANGEABLE_MODEL_DATA
    section, _, name = path.partition(".")
    return section == "train" and name in FIXED_TRAIN


def resume_changes(saved: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """The fields that differ, as ``(path, saved value, new value)`` sorted by path.

    Raises:
        ConfigError: a change to a field fixed for the run (the message names the field and both values).
    """
    before, after = _flatten(saved.to_dict()), _flatten(new.to_dict())
    changes = [(k, before.get(k), after.get(k)) for k in sorted(set(before) | set(after))
               if before.get(k) != after.get(k)]
    for path, was, now in changes:
        if is_fixed(path):
            raise ConfigError(f"{path}: cannot change when resuming (the run was trained with {format_value(was)}, "
                              f"got {format_value(now)}); start a new run with another --out to change it")
    return changes


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    """``train.steps 300 -> 600, monitor.collapse_from_step null -> 50`` (values as a config writes them)."""
    return ", ".join(f"{path} {format_value(was)} -> {format_value(now)}" for path, was, now in changes)


def require_steps_reach(steps: int, step: int, location: str, which: str = "the checkpoint") -> None:
    """A resumed run's ``train.steps`` must reach the step it resumes from (the trainer, and ``--resume --dry-run``).

    Args:
        steps: ``train.steps`` of the resumed config.
        step: the step of ``which`` (the checkpoint found in ``location``).
        location: where that checkpoint is, for the message.
        which: how the message names it.
    Raises:
        ConfigError: ``steps < step``, naming both.
    """
    if steps < step:
        raise ConfigError(f"train.steps: {steps} is below the step of {which} to resume ({step}, {location}); give "
                          f"at least {step}")
