"""Restarts without a person: what a resumed run records about the work it lost, and how a process learns that
torchrun's elastic agent restarted its group.

``torchrun --max-restarts N`` restarts every worker of the job when one fails (a killed rank, a lost node) and sets
``TORCHELASTIC_RESTART_COUNT`` to the number of restarts so far (0 on the first start). ``moetrain train`` then
resumes the run in ``--out`` from its newest checkpoint that verifies, as ``--resume`` would (commands/train.py), so
the job continues by itself; ``--overwrite`` applies to the first start only.

Each resume that lost work (steps logged after the checkpoint it resumes from) or follows a torchrun restart writes
one ``metrics.jsonl`` record before the recomputed steps: ``{"step": S, "event": "resume", "resumed_from_step": S,
"lost_steps": L, "last_logged_step": S + L, "torchrun_restart": N}``. ``lost_steps`` counts the steps the
interrupted process had logged beyond the checkpoint (with ``train.log_every > 1`` up to ``log_every - 1`` more may
have run unlogged); those records are dropped from the file, since the resumed run trains those steps again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's elastic agent for every worker it starts


def torchrun_restart() -> int:
    """How many times torchrun's elastic agent has restarted this worker group (0: first start, or not torchrun).

    Raises:
        ValueError: the variable is set but not an integer (torchrun always writes one).
    """
    return int(os.environ.get(RESTART_ENV, "0") or "0")


def last_logged_step(path: Path) -> int | None:
    """The largest ``step`` of a record with ``train_loss`` in ``metrics.jsonl`` at ``path`` (lines cut short by a
    crash skipped); ``None`` without one."""
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "train_loss" in record and isinstance(record.get("step"), int):
            last = record["step"] if last is None else max(last, record["step"])
    return last


def resume_record(resumed_from: int, last_logged: int | None, restart: int) -> dict[str, Any] | None:
    """The ``metrics.jsonl`` record of a resume from step ``resumed_from`` (0: no checkpoint yet) after a process
    that had logged up to ``last_logged``, in the ``restart``-th torchrun restart; ``None`` when nothing was lost
    and no agent restarted the group (a planned stop and ``--resume``)."""
    lost = max((last_logged or 0) - resumed_from, 0)
    if lost == 0 and restart == 0:
        return None
    return {"step": resumed_from, "event": "resume", "resumed_from_step": resumed_from, "lost_steps": lost,
            "last_logged_step": last_logged if last_logged is not None else resumed_from, "torchrun_restart": restart}
