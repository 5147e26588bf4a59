"""Metrics sinks: ``metrics.jsonl`` (one JSON object per logged step, appended) and TensorBoard scalars."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moetrain.runtime.oserrors import writing


class MetricsLogger:
    """Appends records to ``RUN_DIR/metrics.jsonl`` and mirrors numeric fields to TensorBoard (``RUN_DIR/tb``).

    Each record must hold ``step``; other values are floats (non-finite values are written as ``null`` in JSON so
    the file stays valid JSON).
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        """``resume_step``: the run continues after this step (a resume), so records of later steps, written
        before a crash and about to be recomputed, are dropped from ``metrics.jsonl`` and from TensorBoard
        (``purge_step``); -1 drops everything."""
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None:
            truncate_records(self.path, resume_step)
        purge = None if resume_step is None else max(resume_step + 1, 0)
        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        # a full disk fails the buffered write with an errno but no file name: name the file here
        with writing("the metrics log", self.path), open(self.path, "a") as f:
            f.write(json_line(record))
        # All scalars of a record in one event (what add_scalar writes, but once): each event is a hand-over to the
        # writer thread, which cost ~0.1 ms per key with the per-layer routing statistics.
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in record.items()
                  if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]
        if values:
            writer = self.writer._get_file_writer()  # type: ignore[no-untyped-call]  # untyped in torch
            writer.add_summary(Summary(value=values), record["step"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one JSON line, non-finite floats as ``null`` (so the file stays valid JSON)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    return json.dumps(clean) + "\n"


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of ``path`` (``metrics.jsonl``, ``alerts.jsonl``): its lines that are JSON objects with an integer
    ``step``, in file order, and how many other non-blank lines were skipped (one cut short by a crash, or a run in
    progress's partial last line); ``([], 0)`` without the file."""
    if not path.is_file():
        return [], 0
    out, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if isinstance(item, dict) and isinstance(item.get("step"), int):
            out.append(item)
        else:
            skipped += 1
    return out, skipped


def truncate_records(path: Path, last_step: int) -> None:
    """Keep only the records of ``path`` (``metrics.jsonl``, ``alerts.jsonl``) with ``step <= last_step``, dropping
    any line cut short by a crash; the file is rewritten atomically (a crash leaves the old or the new content)."""
    if not path.exists():
        return
    from moetrain.train.checkpoint import write_file_atomic

    kept = [r for r in read_records(path)[0] if r["step"] <= last_step]
    write_file_atomic(path, "".join(json_line(r) for r in kept).encode())
