"""Helpers for the crash / resume tests: CLI runs in child processes that can be killed, and run-dir readers.

Children come from a ``forkserver`` that has already imported torch and moetrain, so each start costs a fork
instead of ~6 s of imports on 2 cores; each child is still a separate process running ``moetrain.cli.main`` as the
``moetrain`` command does (its own signal handlers, exit status, stdout/stderr redirected to a log file).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

_PRELOAD = ["torch", "torch._inductor.config", "torch.utils.tensorboard", "moetrain.cli", "moetrain.commands.train",
            "moetrain.train.trainer", "_crash_util"]
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _child(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered: the log shows progress as it happens
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    import torch

    torch.set_num_threads(1)  # the same in every child (and cheaper next to other processes on 2 cores)
    import threading

    from tqdm.auto import tqdm

    # tqdm's default lock is a multiprocessing semaphore; a SIGKILLed child would leak it (a warning at exit).
    tqdm.set_lock(threading.RLock())
    from moetrain.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def start_cli(argv: list[str], log_path: Path, env: dict[str, str] | None = None, daemon: bool = True):
    """Start ``moetrain ARGV`` in a child process; returns the ``multiprocessing.Process`` (``.pid``, ``.kill()``,
    ``.terminate()``, ``.exitcode``: negative for a signal). ``daemon=False`` for a child that starts processes of
    its own (``data.workers`` > 0: a daemonic process may not have children); the caller then kills it if needed."""
    p = _context().Process(target=_child, args=(list(argv), str(log_path), dict(env or {})), daemon=daemon)
    p.start()
    return p


def run_cli(argv: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float = 300,
            daemon: bool = True) -> int:
    """Run ``moetrain ARGV`` in a child process to completion; returns its exit status."""
    p = start_cli(argv, log_path, env, daemon)
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise TimeoutError(f"moetrain {' '.join(argv)} did not finish in {timeout} s; log:\n{log_path.read_text()}")
    return p.exitcode


def metrics(run: Path) -> list[dict]:
    """The records of ``run/metrics.jsonl`` (a line cut short by a kill is ignored)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def losses_by_step(run: Path) -> dict[int, float]:
    """``{step: train_loss}`` from metrics.jsonl; a step logged twice is an error (a resume must not duplicate)."""
    out: dict[int, float] = {}
    for r in metrics(run):
        if "train_loss" in r:
            assert r["step"] not in out, f"step {r['step']} logged twice in {run}/metrics.jsonl"
            out[r["step"]] = r["train_loss"]
    return out


def val_by_step(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in metrics(run) if "val_loss" in r}


def last_logged_step(run: Path) -> int:
    steps = [r["step"] for r in metrics(run) if "train_loss" in r]
    return max(steps, default=0)


def wait_for(condition, timeout: float, proc=None, poll: float = 0.005) -> bool:
    """Poll ``condition()`` until true (True), ``timeout`` seconds pass or ``proc`` exits (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc is not None and not proc.is_alive():
            return bool(condition())
        time.sleep(poll)
    return False


def tree_digest(root: Path) -> dict[str, str]:
    """``{relative path: SHA-256}`` of every file below ``root`` (to prove a command left a run untouched)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
