"""The ``moetrain`` subcommands, one module each, and the option checks they share."""

from __future__ import annotations

from pathlib import Path

from moetrain.errors import ConfigError, MoetrainError


def check_at_least(args, minimum: int, *names: str) -> None:
    """Refuse each option ``--NAME`` of ``names`` whose value is below ``minimum`` (one not given, or that this
    command does not have, passes).

    Raises:
        ConfigError: ``--NAME: must be >= MINIMUM, got VALUE``.
    """
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= {minimum}, got {value}")


def check_output_path(path: Path, flag: str, kind: str = "directory", overwrite: bool | None = None,
                      overwrite_does: str = "replace it") -> None:
    """Refuse an output ``path`` that cannot be written as a ``kind`` (``directory`` or ``file``): an existing path
    of the other kind, or a parent path that is a file; with ``overwrite=False`` also a non-empty directory (the
    message says that ``--overwrite`` would ``overwrite_does``).

    Raises:
        MoetrainError: naming ``flag`` and the path.
    """
    if overwrite is False and path.is_dir() and any(path.iterdir()):
        raise MoetrainError(f"{flag} {path}: exists and is not empty; pass --overwrite to {overwrite_does}, or "
                            f"choose another {flag}")
    if kind == "directory" and path.exists() and not path.is_dir():
        raise MoetrainError(f"{flag} {path}: exists and is not a directory")
    if kind == "file" and path.is_dir():
        raise MoetrainError(f"{flag} {path}: is a directory; give a file name such as {path / 'bench.json'}")
    if any(p.exists() and not p.is_dir() for p in path.parents):
        raise MoetrainError(f"{flag} {path}: a parent path is a file, not a directory")
