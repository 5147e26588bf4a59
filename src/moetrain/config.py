"""The run configuration: model + data + training, built from a preset, a file and command-line overrides.

Precedence (later wins): preset -> ``--config`` file -> ``FIELD=VALUE`` overrides. Unknown keys, wrong types and
impossible combinations raise :class:`~moetrain.errors.ConfigError` naming the field path. Fields of an older
layout (:data:`LEGACY_PATHS`) still load, each with a one-line note naming its new path (:func:`upgrade`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moetrain.configlib import check_types, from_dict, merge, print_note, rename_legacy, require, to_dict
from moetrain.data.config import DataConfig
from moetrain.errors import ConfigError
from moetrain.model.config import ModelConfig
from moetrain.parallel.config import ParallelConfig
from moetrain.train.config import TrainConfig
from moetrain.train.monitor_config import MonitorConfig


# Old field path -> new one: old run directories' config.json, --config files and FIELD=VALUE overrides with these
# paths still load, with a note.
_OLD_MOE = {
    "expert_ffn_hidden": "experts.ffn_hidden", "expert_activation": "experts.activation",
    "shared_expert_ffn_hidden": "shared_expert.ffn_hidden", "shared_expert_gate": "shared_expert.gate",
    "score_func": "router.score_func", "norm_topk_prob": "router.norm_topk_prob",
    "routed_scaling_factor": "router.routed_scaling_factor", "num_groups": "router.num_groups",
    "topk_groups": "router.topk_groups", "expert_bias": "router.expert_bias",
    "expert_bias_update_rate": "router.expert_bias_update_rate", "router_jitter": "router.jitter_eps",
    "capacity_factor": "capacity.factor", "eval_capacity_factor": "capacity.eval_factor",
    "min_capacity": "capacity.min_capacity", "drop_policy": "capacity.drop_policy",
    "pad_to_capacity": "capacity.pad_to_capacity",
    **{name: f"losses.{name}" for name in ("aux_loss_coeff", "pooled_aux_loss_coeff", "seq_aux_loss_coeff",
                                           "global_aux_loss_coeff", "z_loss_coeff", "util_loss_coeff")},
}
LEGACY_PATHS: dict[str, str] = {
    **{f"model.moe.{old}": f"model.moe.{new}" for old, new in _OLD_MOE.items()},
    "model.moe.backend": "model.execution.moe_backend",
    "model.moe.recompute_experts": "model.execution.recompute_experts",
    "model.bta_tiles": "model.execution.bta_tiles",
}


def upgrade(data: dict[str, Any], note: Callable[[str], None] = print_note) -> dict[str, Any]:
    """``data`` (raw config data of one source) with every :data:`LEGACY_PATHS` field moved to its new path, and
    a ``note: OLD is now NEW`` line for each (default: stderr). Apply it to each source before merging sources.

    Raises:
        ConfigError: a field given under both its old and new path with different values.
    """
    return rename_legacy(data, LEGACY_PATHS, note)


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run. ``preset`` records which preset the run started from (informational)."""

    preset: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        require(self.model.moe.num_experts % self.parallel.ep == 0, "parallel.ep",
                f"expert-parallel size {self.parallel.ep} does not divide model.moe.num_experts="
                f"{self.model.moe.num_experts} (each EP rank holds num_experts / ep experts)")
        require(self.data.seq_len <= self.model.max_seq_len, "data.seq_len",
                f"sequence length {self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        tokens = self.train.tokens_per_batch
        if tokens:
            require(self.data.packing == "documents", "train.tokens_per_batch",
                    f"{tokens} needs data.packing=documents (got {self.data.packing!r}): token budgets batch whole "
                    "documents")
            require(tokens >= self.data.seq_len, "train.tokens_per_batch",
                    f"{tokens} is below data.seq_len={self.data.seq_len}: the longest document chunk would not fit")
        require(self.train.batch_size % self.model.execution.bta_tiles == 0, "model.execution.bta_tiles",
                f"{self.model.execution.bta_tiles} attention tiles do not divide the micro-batch "
                f"train.batch_size={self.train.batch_size}; choose a divisor of it")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], note: Callable[[str], None] = print_note) -> "Config":
        """Build from plain data (old field paths are moved, with a note: :func:`upgrade`).

        Raises:
            ConfigError: as :func:`moetrain.configlib.from_dict`; an unknown key close to an old field name is
                answered with that field's new path.
        """
        return from_dict(cls, upgrade(data, note), legacy=LEGACY_PATHS)


def check_router_trainable(config: Config) -> None:
    """Refuse to train an MoE whose router cannot learn from the language-model loss.

    With ``model.moe.top_k = 1`` and ``model.moe.router.norm_topk_prob = true`` every gating weight is renormalised
    to exactly 1, so the router logits get no gradient from the LM loss, only from the auxiliary losses, which push
    towards uniform routing: the routing stays what the initialisation made it. Switch Transformer's top-1 weights
    the expert by its router probability (``norm_topk_prob = false``). Checked for new training runs (``moetrain
    train``, ``moetrain compare``); loading, serving and resuming such a model are unaffected.

    Raises:
        ConfigError: naming ``model.moe.router.norm_topk_prob``.
    """
    moe = config.model.moe
    if config.model.moe_layer_indices and moe.top_k == 1 and moe.num_experts > 1 and moe.router.norm_topk_prob:
        raise ConfigError(
            "model.moe.router.norm_topk_prob: true with model.moe.top_k=1 renormalises every gating weight to 1, so "
            "the router gets no gradient from the language-model loss (only from the aux losses); set "
            "model.moe.router.norm_topk_prob=false (Switch Transformer's top-1: the weight is the router probability)")


def choose_preset(preset: str | None = None, file_data: dict | None = None, overrides: dict | None = None) -> str:
    """The preset a run starts from: ``--preset``, else a ``preset`` key of the ``--config`` file, else a
    ``preset=NAME`` override, else ``cpu-small``. A ``preset`` key applies that preset's values (then the file's
    other fields on top), it is not only a label.

    Raises:
        ConfigError: two of them name different presets, or a preset that is not a string.
    """
    given = [(src, value) for src, value in (("--preset", preset), ("--config file's preset", (file_data or {}).get(
        "preset")), ("override preset", (overrides or {}).get("preset"))) if value is not None]
    from moetrain.presets import PRESETS

    for src, value in given:
        if not isinstance(value, str):
            raise ConfigError(f"preset: {src} must be a preset name (a string), got {value!r}")
        if src != "--preset" and value not in PRESETS:  # preset_dict's message names --preset
            raise ConfigError(f"preset: {src} {value!r} is not a preset; choose one of {sorted(PRESETS)}")
    names = {value for _, value in given}
    if len(names) > 1:
        raise ConfigError("preset: " + " and ".join(f"{src} {value!r}" for src, value in given)
                          + " disagree; give one preset")
    return given[0][1] if given else "cpu-small"


def build_config(preset: str | None = None, file_data: dict | None = None, overrides: dict | None = None) -> Config:
    """Preset (see :func:`choose_preset`; default ``cpu-small``), then file values, then overrides.

    Raises:
        ConfigError: unknown or conflicting presets, unknown keys, wrong types, invalid values (the message names
            the field path).
    """
    from moetrain.presets import preset_dict

    data = preset_dict(choose_preset(preset, file_data, overrides))
    for source in (file_data, overrides):
        if source:
            source = upgrade(source)
            check_types(Config, source, legacy=LEGACY_PATHS)  # a value the next source replaces is checked too
            data = merge(data, source)
    return Config.from_dict(data)
