"""Reading a run directory's logs (finished or in progress): ``config.json``, ``metrics.jsonl``, ``alerts.jsonl``.

A run in progress may end ``metrics.jsonl`` with a line cut short mid-write; such lines (and any other line that is
not a JSON object with an integer ``step``) are skipped and counted, never fatal. Routing statistics use the flat
keys written by :mod:`moetrain.train.monitor` (``moe/layerL/<stat>``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetrain.errors import MoetrainError
from moetrain.train.alerts import read_alerts
from moetrain.train.metrics import read_records

_LAYER_KEY = re.compile(r"^moe/layer(\d+)/(.+)$")


@dataclass
class RunLog:
    """One run's logs.

    Attributes:
        run_dir: the run directory.
        config: ``config.json`` as a dict (``None`` if absent or unreadable).
        records: ``metrics.jsonl`` records in file order.
        alerts: ``alerts.jsonl`` records.
        skipped_lines: unreadable ``metrics.jsonl`` lines (a partial last line of a run in progress).
    """

    run_dir: Path
    config: dict[str, Any] | None
    records: list[dict[str, Any]]
    alerts: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0

    def layers(self) -> list[int]:
        """Transformer-block indices of the MoE layers that have routing statistics, ascending."""
        return sorted({int(m.group(1)) for rec in self.records for key in rec if (m := _LAYER_KEY.match(key))})

    def series(self, key: str) -> tuple[list[int], list[Any]]:
        """(steps, values) of every record holding a non-null ``key``."""
        held = [rec for rec in self.records if rec.get(key) is not None]
        return [rec["step"] for rec in held], [rec[key] for rec in held]

    def latest(self, key: str) -> tuple[int, Any] | tuple[None, None]:
        """(step, value) of the newest record holding a non-null ``key``."""
        for rec in reversed(self.records):
            if rec.get(key) is not None:
                return rec["step"], rec[key]
        return None, None

    def layer_stats(self, layer: int) -> tuple[int | None, dict[str, Any]]:
        """(step, {stat: value}) of the newest record with routing statistics of ``layer``."""
        prefix = f"moe/layer{layer}/"
        for rec in reversed(self.records):
            stats = {k[len(prefix):]: v for k, v in rec.items() if k.startswith(prefix)}
            if stats:
                return rec["step"], stats
        return None, {}

    def _moe_config(self) -> dict[str, Any] | None:
        try:
            moe = self.config["model"]["moe"]  # type: ignore[index]
        except (TypeError, KeyError):
            return None
        return moe if isinstance(moe, dict) else None

    def _moe_int(self, key: str, default: int | None) -> int | None:
        """``model.moe.KEY`` of the run's config as an int (``default`` when the config is unknown)."""
        try:
            return int((self._moe_config() or {})[key])
        except (KeyError, TypeError, ValueError):
            return default

    def num_experts(self) -> int | None:
        """The run's routed experts E (``None`` when the config is unknown)."""
        return self._moe_int("num_experts", None)

    def has_moe_layers(self) -> bool:
        """Whether some block is MoE under the run's ``model.moe_every`` / ``first_k_dense`` (``True`` when the
        config is unknown): a dense run logs no routing statistics."""
        from moetrain.model.config import is_moe_block

        model = self.config.get("model") if isinstance(self.config, dict) else None
        try:
            every, first = int(model.get("moe_every", 1)), int(model.get("first_k_dense", 0))  # type: ignore[union-attr]
            return any(is_moe_block(i, every, first) for i in range(int(model["n_layers"])))  # type: ignore[index]
        except (AttributeError, KeyError, TypeError, ValueError):
            return True

    def dropless(self) -> bool | None:
        """Whether the run's MoE layers have no capacity (``model.moe.capacity.factor`` null), so they never drop a
        token; ``None`` when the config is unknown."""
        moe = self._moe_config()
        if moe is None:
            return None
        capacity = moe.get("capacity")
        return not isinstance(capacity, dict) or capacity.get("factor") is None

    def top_k(self) -> int:
        """The run's top-k (1 when the config is unknown)."""
        return self._moe_int("top_k", 1) or 1


def refuse_hugging_face_dir(root: Path, config: Any) -> None:
    """Raise if ``config`` (the parsed ``config.json`` of ``root``) is transformers', not a run's: a directory written
    by ``moetrain export`` / ``upcycle`` is served, not read as a run.

    Raises:
        MoetrainError: naming the directory and its ``model_type``.
    """
    if isinstance(config, dict) and "model_type" in config and "model" not in config:
        raise MoetrainError(f"{root}: a Hugging Face directory (model_type {config['model_type']!r}), not a moetrain "
                            f"run directory; serve it with `moetrain serve {root}`")


def load_run_log(run_dir: str | Path) -> RunLog:
    """Read the logs of ``run_dir``.

    Raises:
        MoetrainError: ``run_dir`` is not a directory, holds neither ``metrics.jsonl`` nor ``config.json``, or is a
            Hugging Face directory.
    """
    root = Path(run_dir)
    metrics_path, config_path = root / "metrics.jsonl", root / "config.json"
    if not root.is_dir():
        raise MoetrainError(f"{root}: no such run directory")
    if not metrics_path.is_file() and not config_path.is_file():
        raise MoetrainError(f"{root}: neither metrics.jsonl nor config.json found; is it a moetrain run directory?")
    config = None
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError):
            config = None
        refuse_hugging_face_dir(root, config)
    records, skipped = read_records(metrics_path)
    return RunLog(run_dir=root, config=config, records=records, alerts=read_alerts(root), skipped_lines=skipped)
