"""The machine a run executes on: OS errors as one line (``oserrors``), memory pre-flight (``preflight``), CPU
features and bf16 policy (``cpu``), intra-op thread choice (``threads``), moetrain's cache directory (below)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(configured: str | None = None) -> Path:
    """moetrain's cache (tokenizers and token memmaps, built CPU kernels): ``configured`` (``data.cache_dir``), else
    ``$MOETRAIN_CACHE``, else ``~/.cache/moetrain``; ``~`` expanded."""
    return Path(configured or os.environ.get("MOETRAIN_CACHE") or Path.home() / ".cache" / "moetrain").expanduser()
