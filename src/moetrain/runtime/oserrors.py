"""Errors from the machine (read-only or full disks, permissions) as one line naming the path and what was being
written, the same care as a bad config value gets (exit status 2, no traceback; ``--debug`` shows it).

``writing(what, path)`` wraps a write whose purpose the code knows ("the run directory", "checkpoint step_00000100");
``cli.main`` turns any other ``OSError`` into :func:`os_error_line` as a last resort.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path

from moetrain.errors import MoetrainError

# What to try, per errno, in a few words.
_HINTS = {
    errno.ENOSPC: "free some space or choose another --out",
    errno.EDQUOT: "free some space (disk quota) or choose another --out",
    errno.EROFS: "the file system is read-only; choose another --out",
    errno.EACCES: "no permission; choose another --out or fix the permissions",
    errno.EPERM: "no permission; choose another --out or fix the permissions",
}


class MachineError(MoetrainError):
    """An ``OSError`` while reading or writing a file, with the path and what was being written."""


def os_error_line(e: OSError, what: str | None = None, path: str | os.PathLike | None = None) -> str:
    """One line for ``e``: ``cannot write WHAT (PATH): STRERROR; HINT``, or without ``what`` (an error the code did
    not expect, caught by the CLI) ``PATH: STRERROR; HINT``. ``path`` defaults to the error's own file name.
    """
    where = path if path is not None else e.filename
    reason = e.strerror or str(e) or type(e).__name__
    hint = _HINTS.get(e.errno or -1)
    if what is None:
        text = f"{os.fspath(where)}: {reason}" if where is not None else f"{type(e).__name__}: {reason}"
        if e.filename2 is not None:
            text = f"{os.fspath(where)} -> {os.fspath(e.filename2)}: {reason}"
    else:
        text = f"cannot write {what}" + (f" ({os.fspath(where)})" if where is not None else "")
        if e.filename is not None and path is not None and os.fspath(e.filename) != os.fspath(path):
            text += f" at {os.fspath(e.filename)}"
        text += f": {reason}"
    return f"{text}; {hint}" if hint else text


@contextmanager
def writing(what: str, path: str | os.PathLike | Path | None = None):
    """Turn an ``OSError`` raised inside the block into a :class:`MachineError` naming ``what`` and ``path``."""
    try:
        yield
    except MachineError:
        raise
    except OSError as e:
        raise MachineError(os_error_line(e, what, path)) from e


def quiet_thread_os_errors() -> None:
    """Make an ``OSError`` that ends a background thread (TensorBoard's event writer on a full disk) one line on
    stderr instead of a traceback; other exceptions keep Python's default report. The writer re-raises the error
    in the main thread at its next write or close, where the CLI turns it into its one-line error."""
    import sys
    import threading

    default = threading.excepthook

    def hook(args) -> None:  # noqa: ANN001 -- threading.ExceptHookArgs
        if isinstance(args.exc_value, OSError):
            name = args.thread.name if args.thread is not None else "a background thread"
            print(f"moetrain: warning: {name}: {os_error_line(args.exc_value)}", file=sys.stderr)
            return
        default(args)

    if not getattr(threading.excepthook, "moetrain_quiet", False):
        setattr(hook, "moetrain_quiet", True)  # a marker attribute, which a function's type does not declare
        threading.excepthook = hook
