"""Restarts without a person: what a resumed run records about the work it lost, and how a process learns that
torchrun's elastic agent restarted its group (``TORCHELASTIC_RESTART_COUNT``; ``moetrain train`` then resumes from
the newest checkpoint that verifies, as ``--resume`` would). The ``metrics.jsonl`` record of such a resume:
:func:`resume_record`; docs/scale-out.md, "When a rank or a node is lost".
"""

from __future__ import annotations

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
    from moetrain.train.metrics import read_records

    steps = [r["step"] for r in read_records(path)[0] if "train_loss" in r]
    return max(steps, default=None)


def resume_record(resumed_from: int, last_logged: int | None, restart: int) -> dict[str, Any] | None:
    """The ``metrics.jsonl`` record of a resume from step ``resumed_from`` (0: no checkpoint yet) after a process
    that had logged up to ``last_logged``, in the ``restart``-th torchrun restart; ``None`` when nothing was lost
    and no agent restarted the group (a planned stop and ``--resume``)."""
    lost = max((last_logged or 0) - resumed_from, 0)
    if lost == 0 and restart == 0:
        return None
    return {"step": resumed_from, "event": "resume", "resumed_from_step": resumed_from, "lost_steps": lost,
            "last_logged_step": last_logged if last_logged is not None else resumed_from, "torchrun_restart": restart}
