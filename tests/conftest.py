"""Shared test fixtures: a small corpus inside the repository (never the network, never a file beside it) and CPU
thread settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# 399 KB of tinyshakespeare (public domain; tests/data/README.md).
SHAKESPEARE = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"

torch.set_num_threads(min(2, torch.get_num_threads()))
# bf16 tests test bf16 whatever the CPU: without native bf16 the library would run them in fp32
# (moetrain.runtime.cpu); the policy's own tests override this.
os.environ.setdefault("MOETRAIN_BF16", "bf16")


def sample_text(n_bytes: int) -> bytes:
    """The first ``n_bytes`` of :data:`SHAKESPEARE`, the text repeated where ``n_bytes`` is longer than the file
    (399,862 bytes)."""
    text = SHAKESPEARE.read_bytes()
    return (text * (n_bytes // len(text) + 1))[:n_bytes]


@pytest.fixture
def code_corpus(tmp_path: Path) -> Path:
    """A small directory of Python-like text (about 200 KB), generated locally."""
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(12):
        lines = []
        for j in range(150):
            lines.append(f"def function_{i}_{j}(value, count={j}):")
            lines.append(f"    \"\"\"Return value scaled by {j} and shifted by count.\"\"\"")
            lines.append(f"    result = value * {j} + count - {i}")
            lines.append("    return result\n")
        (root / f"module_{i:02d}.py").write_text("\n".join(lines))
    return root


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a shared
    2-core machine two OpenMP threads per process can be ~30x slower (both spin while the other is descheduled);
    results are compared within one thread setting only."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
