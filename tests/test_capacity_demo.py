"""benchmarks/capacity_demo.py passes: under one RLIMIT_DATA cap, one process refuses a model in one line naming a
layout, and parallel.dp_shard=4 on 4 processes trains it (``-m slow``: a few minutes on 2 cores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_parallel_cli import _corpus

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_capacity_demo_passes(tmp_path):
    _corpus(tmp_path / "corpus")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "capacity_demo.py"), "--data",
                           str(tmp_path / "corpus")], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "PASS"
    refused = next(x for x in lines if x.startswith("1 process: exit 2: moetrain: error: "))
    assert "RLIMIT_DATA" in refused and "(out of memory); try parallel.dp_shard=" in refused
