"""Collective time-outs: when one rank of a 2-rank EP job dies (SIGKILL) or hangs (SIGSTOP) mid-training, the
other exits non-zero with one line naming the collective it was in, instead of waiting forever. And when only one
rank gets SIGTERM (preemption), both stop after the same step, write one sharded checkpoint together and exit 0.

The ranks are started as plain processes with torchrun's environment variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``), not by torchrun itself, whose agent would tear the survivor down
first. The scenarios run at once (the waits overlap).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _parallel_util import free_port
from moetrain.config import build_config
from moetrain.data.dataset import prepare_data
from test_parallel_cli import _corpus

TIMEOUT_S = 5  # parallel.timeout_s of the hung job


def _launch(tmp: Path, name: str, timeout_s: float) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        args = [sys.executable, "-m", "moetrain", "train", "--preset", "tiny", "--data", str(tmp / "corpus"),
                "--out", str(tmp / name), "--no-progress", f"data.cache_dir={tmp / 'cache'}", "train.steps=100000",
                "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0", "train.eval_batches=1",
                "parallel.ep=2", f"parallel.timeout_s={timeout_s}"]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _trained_a_step(run: Path) -> bool:
    metrics = run / "metrics.jsonl"
    return metrics.is_file() and any("train_loss" in json.loads(line) for line in metrics.read_text().splitlines())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("faults")
    _corpus(tmp / "corpus")
    # Fill the data cache once here, so the two jobs' rank 0s do not both train a tokenizer on 2 cores.
    cfg = build_config("tiny", overrides={"data": {"path": str(tmp / "corpus"), "cache_dir": str(tmp / "cache")}})
    prepare_data(cfg.data, cfg.model.vocab_size, log=lambda _: None)
    jobs = {"killed": _launch(tmp, "killed", timeout_s=60), "hung": _launch(tmp, "hung", timeout_s=TIMEOUT_S),
            "terminated": _launch(tmp, "terminated", timeout_s=60)}
    how = {"killed": signal.SIGKILL, "hung": signal.SIGSTOP, "terminated": signal.SIGTERM}
    out = {}
    try:
        deadline = time.monotonic() + 300
        pending = set(jobs)
        while pending and time.monotonic() < deadline:
            for name in list(pending):
                survivor, victim = jobs[name]
                if survivor.poll() is not None:  # died before the fault: report its output
                    pending.discard(name)
                elif _trained_a_step(tmp / name):
                    os.kill(victim.pid, how[name])
                    out[name] = {"fault_at": time.monotonic()}
                    pending.discard(name)
            time.sleep(0.2)
        for name, (survivor, victim) in jobs.items():
            try:
                stdout, stderr = survivor.communicate(timeout=120)
            except subprocess.TimeoutExpired:  # the bug this test exists for: the survivor hangs
                survivor.kill()
                stdout, stderr = survivor.communicate()
            end = time.monotonic()
            out.setdefault(name, {}).update(rc=survivor.returncode, stderr=stderr, stdout=stdout,
                                            seconds=end - out.get(name, {}).get("fault_at", end))
            if name == "terminated":
                victim.wait(timeout=120)
                out[name]["victim_rc"] = victim.returncode
    finally:
        for procs in jobs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    out["root"] = tmp
    return out


@pytest.mark.parametrize("name", ["killed", "hung"])
def test_survivor_fails_naming_the_collective(outcomes, name):
    r = outcomes[name]
    assert "fault_at" in r, f"the job ended before the fault was injected: {r['stderr'][-2000:]}"
    assert r["rc"] not in (0, None, -9), r["stderr"][-2000:]
    errors = [line for line in r["stderr"].splitlines() if line.startswith("moetrain: error:")]
    assert len(errors) == 1, r["stderr"][-2000:]
    assert "rank 0: collective " in errors[0] and "over ranks [0, 1]" in errors[0], errors[0]
    assert any(c in errors[0] for c in ("all_to_all_single", "all_reduce", "all_gather", "broadcast",
                                        "FSDP2 all-gather / reduce-scatter")), errors[0]
    print(f"{name}: rank 0 exited {r['rc']} {r['seconds']:.1f} s after the fault: {errors[0]}")


def test_hang_is_reported_as_a_timeout(outcomes):
    """The hung peer's socket stays open, so only the configured time-out can end the wait."""
    errors = [line for line in outcomes["hung"]["stderr"].splitlines() if line.startswith("moetrain: error:")]
    assert errors and f"{TIMEOUT_S * 1000}ms" in errors[0], errors


def test_sigterm_on_one_rank_stops_both_with_a_checkpoint(outcomes):
    r = outcomes["terminated"]
    assert "fault_at" in r, r["stderr"][-2000:]
    assert r["rc"] == 0 and r["victim_rc"] == 0, r["stderr"][-2000:]
    assert "stopped by a signal received by another rank after step" in r["stdout"], r["stdout"][-2000:]
    ckpts = sorted((outcomes["root"] / "terminated" / "checkpoints").glob("step_*"))
    assert ckpts and sorted(p.name for p in ckpts[-1].glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
