"""One trainer per run directory: an OS-level lock on ``RUN_DIR/train.lock``, held for the whole run.

``filelock.FileLock`` takes ``flock`` on the file, which the kernel drops when the holding process exits however
it exits (SIGKILL included), so a lock file left behind by a killed run never blocks the next one; the file itself
stays (empty, harmless). A second ``moetrain train`` on the same directory fails at once instead of interleaving
its checkpoints, metrics and config with the first one's.
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import FileLock, Timeout

from moetrain.errors import MoetrainError

LOCK_FILE = "train.lock"


class RunLock:
    """Context manager: create ``run_dir`` if needed (parents too) and hold its lock until exit.

    Directories it created are removed again on exit when the run wrote nothing into them (bad input found after
    the lock was taken must leave no trace).

    Raises:
        MoetrainError: another process holds the lock (the message names the directory and the lock file).
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._created: list[Path] = []
        self._lock: FileLock | None = None

    def __enter__(self) -> RunLock:
        for d in reversed([p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]):
            try:
                d.mkdir()
                self._created.append(d)
            except FileExistsError:  # made by someone else meanwhile
                pass
        lock = FileLock(str(self.path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            self._remove_created()
            raise MoetrainError(f"run directory '{self.run_dir}' is in use by another moetrain train (it holds the "
                                f"lock {self.path}); wait for it to finish or choose another --out") from None
        self._lock = lock
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._remove_created()

    def _remove_created(self) -> None:
        if not self._created or not self.run_dir.is_dir() or set(os.listdir(self.run_dir)) - {LOCK_FILE}:
            return
        self.path.unlink(missing_ok=True)
        for d in reversed(self._created):
            try:
                d.rmdir()
            except OSError:  # not empty after all (another process wrote there)
                break
        self._created = []
