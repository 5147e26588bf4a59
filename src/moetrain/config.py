"""The run configuration: model + data + training, built from a preset, a file and command-line overrides.

Precedence (later wins): preset -> ``--config`` file -> ``FIELD=VALUE`` overrides. Unknown keys, wrong types and
impossible combinations raise :class:`~moetrain.errors.ConfigError` naming the field path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetrain.configlib import from_dict, merge, require, to_dict
from moetrain.data.config import DataConfig
from moetrain.model.config import ModelConfig
from moetrain.parallel.config import ParallelConfig
from moetrain.train.config import TrainConfig
from moetrain.train.monitor_config import MonitorConfig


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
        require(
            self.model.moe.num_experts % self.parallel.ep == 0,
            "parallel.ep",
            f"expert-parallel size {self.parallel.ep} does not divide model.moe.num_experts="
            f"{self.model.moe.num_experts} (each EP rank holds num_experts / ep experts)",
        )
        require(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            f"sequence length {self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )
        require(
            self.train.batch_size % self.model.bta_tiles == 0,
            "model.bta_tiles",
            f"{self.model.bta_tiles} attention tiles do not divide the micro-batch "
            f"train.batch_size={self.train.batch_size}; choose a divisor of it",
        )

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        return from_dict(cls, data)


def build_config(preset: str | None = None, file_data: dict | None = None, overrides: dict | None = None) -> Config:
    """Preset (default ``cpu-small``), then file values, then overrides.

    Raises:
        ConfigError: unknown preset, unknown keys, wrong types, invalid values (the message names the field path).
    """
    from moetrain.presets import preset_dict

    data = preset_dict(preset or "cpu-small")
    if file_data:
        data = merge(data, file_data)
    if overrides:
        data = merge(data, overrides)
    return Config.from_dict(data)
