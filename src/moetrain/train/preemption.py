"""Graceful stop on SIGTERM / SIGINT (preemptible machines, schedulers, Ctrl-C).

The first signal only sets a flag: the trainer finishes the optimizer step in progress, writes a checkpoint and
returns normally (the CLI exits 0), so at most the step in flight is recomputed after ``--resume``. A second signal
exits at once (status 128 + signal number) without cleanup: checkpoints are atomic, so even an exit in the middle
of a checkpoint write leaves the previous one intact.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Context manager that installs the handlers (main thread only; elsewhere it does nothing) and restores the
    previous ones on exit. ``received`` is the name of the first signal caught (``"SIGTERM"``), else ``None``."""

    def __init__(self) -> None:
        self.received: str | None = None
        # what signal.signal returns: a handler, SIG_DFL / SIG_IGN, or None (not installed from Python)
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: the handler may interrupt a print to the same stream (a reentrant-call error).
        if self.received is not None:
            os.write(2, f"\nmoetrain: second signal ({name}): exiting immediately\n".encode())
            os._exit(128 + signum)
        self.received = name
        os.write(2, f"\nmoetrain: {name} received: finishing the current step, then writing a checkpoint "
                    f"(send it again to exit at once)\n".encode())
