"""Shared by tests/test_serve_*.py: a trained tiny run and a server over it in a background thread."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from conftest import sample_text

from moetrain.cli import main


# the session's intra-op thread count as conftest set it (torch's default, at most 2): what an Engine built in-process
# runs at (`moetrain serve` keeps a core for its HTTP front: runtime.threads.serving_threads); read at collection,
# before any in-process training sets its own
DEFAULT_THREADS = torch.get_num_threads()


@contextlib.contextmanager
def one_thread_now():
    """One intra-op thread inside the block (the engine's steps too): for requests compared token for token with
    each alone, which holds where the batch's other rows cannot change the rounding."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def at_default_threads() -> int:
    """Set the intra-op thread count back to the session's default (training in-process sets one thread) and
    return it."""
    torch.set_num_threads(DEFAULT_THREADS)
    return DEFAULT_THREADS


def train_tiny(root: Path, steps: int = 40) -> Path:
    """A tiny run trained ``steps`` steps on local text (a few seconds on one thread)."""
    corpus = root / "corpus.txt"
    corpus.write_bytes(sample_text(200_000))
    run = root / "run"
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--no-progress",
                 "--steps", str(steps), f"data.cache_dir={root / 'cache'}", "train.eval_batches=1",
                 "train.threads=1", "monitor.tb_heatmap=false"]) == 0
    return run


def start_server(served, cache=None, limits=None, app_kwargs=None, **engine_kwargs):
    """A started :class:`~moetrain.serve.server.BackgroundServer` (``.url``, ``.stop()``) and its engine
    (``limits``: connection :class:`~moetrain.serve.server.Limits`; ``app_kwargs``: for ``create_app``)."""
    from moetrain.serve.api import create_app
    from moetrain.serve.engine import Engine
    from moetrain.serve.server import BackgroundServer

    engine = Engine(served, **engine_kwargs)
    return BackgroundServer(create_app(engine, cache, **(app_kwargs or {})), limits=limits).start(), engine
