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
    the lock was taken must leave no trace); in a directory that existed before, a lock file it created is removed
    when the run ends with an error before writing its ``config.json`` (``--overwrite`` refused on a directory that
    is not a run leaves it as it was).

    Raises:
        MoetrainError: another process holds the lock (the message names the directory and the lock file).
        MachineError: the directory or the lock file cannot be created (read-only file system, permissions); the
            message names the path.
    """

    def __init__(self, run_dir: str | Path, name: str = "run directory", choose: str = "--out"):
        """``name`` and ``choose`` word the refusal (a local ``train.checkpoint_url`` is locked the same way)."""
        self.run_dir = Path(run_dir)
        self.name, self.choose = name, choose
        self.path = self.run_dir / LOCK_FILE
        self._created: list[Path] = []
        self._lock: FileLock | None = None
        self._created_lock_file = False

    def __enter__(self) -> RunLock:
        from moetrain.runtime.oserrors import MachineError, os_error_line, writing

        for d in reversed([p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]):
            try:
                with writing("the run directory", d):
                    d.mkdir()
                self._created.append(d)
            except FileExistsError:  # made by someone else meanwhile
                pass
            except BaseException:
                self._remove_created()
                raise
        self._created_lock_file = not self.path.exists()
        lock = FileLock(str(self.path), timeout=0)
        try:
            lock.acquire()
        except Timeout:  # (a TimeoutError, so an OSError: first)
            self._remove_created()
            raise MoetrainError(f"{self.name} '{self.run_dir}' is in use by another moetrain train (it holds the "
                                f"lock {self.path}); wait for it to finish or choose another {self.choose}") from None
        except OSError as e:
            self._remove_created()
            raise MachineError(os_error_line(e, "the run's lock file", self.path)) from e
        except BaseException:
            self._remove_created()
            raise
        self._lock = lock
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and self._created_lock_file and not (self.run_dir / "config.json").exists():
            self.path.unlink(missing_ok=True)  # still held: nobody else can have taken it meanwhile
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._remove_created()

    def _remove_created(self) -> None:
        """Remove the directories this lock created, unless the run wrote into them (the run directory itself may
        not have been made)."""
        if not self._created or self.run_dir.exists() and (
                not self.run_dir.is_dir() or set(os.listdir(self.run_dir)) - {LOCK_FILE}):
            return
        self.path.unlink(missing_ok=True)
        for d in reversed(self._created):
            try:
                d.rmdir()
            except OSError:  # not empty after all (another process wrote there)
                break
        self._created = []
