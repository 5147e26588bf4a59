"""Metrics sinks: ``metrics.jsonl`` (one JSON object per logged step, appended) and TensorBoard scalars."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Appends records to ``RUN_DIR/metrics.jsonl`` and mirrors numeric fields to TensorBoard (``RUN_DIR/tb``).

    Each record must hold ``step``; other values are floats (non-finite values are written as ``null`` in JSON so
    the file stays valid JSON).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
