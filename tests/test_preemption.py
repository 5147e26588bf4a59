"""Crash safety end to end: SIGKILL at random points (including in the middle of a checkpoint write) and SIGTERM
preemption, each followed by ``--resume``; the final losses and weights must equal an uninterrupted run exactly.

Every run is ``moetrain train`` in its own process (see ``_crash_util``), the tiny preset shrunk to a few
milliseconds per step, a checkpoint every 2 steps and a metrics line every step.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
import torch

from _crash_util import last_logged_step, losses_by_step, metrics, run_cli, start_cli, val_by_step, wait_for
from conftest import sample_text
from moetrain.train.checkpoint import CheckpointStore

# Enough steps that ten kills, each after at most 5 steps past the newest checkpoint, cannot reach the end of the run.
STEPS = 60


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A small corpus, a shared data cache, and the uninterrupted reference run."""
    root = tmp_path_factory.mktemp("preempt")
    corpus = root / "corpus.txt"
    corpus.write_bytes(sample_text(120_000))
    ref = root / "reference"
    args = _args(corpus, root / "cache", ref)
    assert run_cli(args, root / "reference.log") == 0, (root / "reference.log").read_text()
    return root, corpus, ref


def _args(corpus: Path, cache: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--no-progress",
            "--steps", str(STEPS), f"data.cache_dir={cache}", "data.seq_len=32", "train.batch_size=2",
            "train.log_every=1", "train.ckpt_every=2", "train.eval_every=8", "train.eval_batches=1",
            "train.warmup_steps=4", "monitor.tb_heatmap=false", "monitor.tb_histograms=false",
            # State a resume must restore beyond weights and optimizer: aux-loss-free expert biases (buffers updated
            # after each step) and router jitter (draws from the global RNG).
            "model.moe.router.expert_bias=true", "model.moe.router.jitter_eps=0.01", *extra]


def _read(log: Path) -> str:
    return log.read_text() if log.exists() else ""


def _resume(args: list[str]) -> list[str]:
    """The same command with ``--resume`` (the run keeps its own preset, so ``--preset`` goes)."""
    i = args.index("--preset")
    return [*args[:i], *args[i + 2:], "--resume"]


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    store = CheckpointStore(run / "checkpoints")
    ckpt, skipped = store.latest_valid(warn=lambda m: None)
    assert ckpt is not None and ckpt.step == STEPS and not skipped
    return ckpt.model_tensors()


def _assert_same_as_reference(run: Path, ref: Path) -> None:
    got, want = losses_by_step(run), losses_by_step(ref)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert got == want  # exact float equality, step by step
    assert val_by_step(run) == val_by_step(ref)
    # Every other logged number too (routing statistics, aux losses, grad norms, LR), except wall-clock rates.
    assert _records(run) == _records(ref)
    got_w, want_w = _final_weights(run), _final_weights(ref)
    assert sorted(got_w) == sorted(want_w)
    for name in want_w:  # every parameter and buffer, bit for bit
        assert torch.equal(got_w[name], want_w[name]), name
    biases = [t for name, t in want_w.items() if name.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # the biases did move, so they were compared


def _records(run: Path) -> list[dict]:
    """The records but their timings and the resume records (``"event": "resume"``, which a killed run adds: each
    names a checkpoint step and the steps logged after it, now recomputed)."""
    timing = ("tokens_per_s", "step_time", "seconds", "elapsed", "mfu", "data_wait_s", "monitor_s", "mem/")
    records = metrics(run)
    for r in records:
        if r.get("event") == "resume":
            assert r["last_logged_step"] - r["resumed_from_step"] == r["lost_steps"] >= 1, r
    return [{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in records if "event" not in r]


def _all_complete_checkpoints_verify(run: Path) -> list[int]:
    """No complete-looking checkpoint is partial: each ``step_*`` directory verifies against its manifest."""
    store = CheckpointStore(run / "checkpoints")
    for name in store.names():
        assert store.verify(name) is None, f"{name} is partial or corrupt after a kill"
    return [int(n.split("_")[1]) for n in store.names()]


def _tmp_dirs(run: Path) -> list[Path]:
    ckpts = run / "checkpoints"
    return list(ckpts.glob(".tmp-step_*")) if ckpts.is_dir() else []


def _kill_test(setup, kills: int, seed: int, tmp_path: Path) -> None:
    root, corpus, ref = setup
    rng = random.Random(seed)
    run = tmp_path / "run"
    args = _args(corpus, root / "cache", run)
    # Kill points: some in the middle of a checkpoint write (the write is slowed down so the kill lands between two
    # files), one during start-up, the rest a random number of steps after the last checkpoint.
    # The start-up kill comes first: later, a resumed run on a fast machine could finish before it lands.
    rest = ["during_write"] * 3 + ["steps"] * (kills - 4)
    rng.shuffle(rest)
    plan = ["startup", *rest]
    resumed_from: list[int] = []
    mid_write_kills = 0
    for attempt, mode in enumerate(plan):
        log = tmp_path / f"attempt{attempt}.log"
        before = max(_all_complete_checkpoints_verify(run), default=0) if run.exists() else 0
        env = {"MOETRAIN_CKPT_WRITE_DELAY": "0.15"} if mode == "during_write" else {}
        proc = start_cli((_resume(args) if attempt else args), log, env)
        if mode == "startup":
            # Killed while starting (after the run directory's config is written, so `--resume` knows the run).
            assert wait_for(lambda: (run / "config.json").exists(), 120, proc), _read(log)
            wait_for(lambda: False, rng.uniform(0.0, 0.3), proc)
        elif mode == "during_write":
            assert wait_for(lambda: bool(_tmp_dirs(run)), 120, proc), _read(log)
            wait_for(lambda: False, rng.uniform(0.0, 0.6), proc)  # somewhere among the 5 files of 0.15 s each
        else:
            if attempt:  # metrics.jsonl still holds the killed run's steps until the resume has truncated it
                assert wait_for(lambda: "resumed from" in _read(log) or "no checkpoint" in _read(log),
                                120, proc), _read(log)
            target = before + rng.randint(1, 5)
            assert wait_for(lambda: last_logged_step(run) >= target, 120, proc), _read(log)
            wait_for(lambda: False, rng.uniform(0.0, 0.15), proc)
        assert proc.is_alive(), f"attempt {attempt} ({mode}) ended before the kill:\n{_read(log)}"
        in_write = bool(_tmp_dirs(run))
        proc.kill()
        proc.join()
        assert proc.exitcode == -9
        mid_write_kills += in_write
        steps = _all_complete_checkpoints_verify(run) if (run / "checkpoints").exists() else []
        assert not steps or max(steps) <= STEPS
        text = _read(log)
        if attempt and "resumed from" in text:
            step = int(text.split("resumed from ")[1].split(" at step ")[1].split()[0])
            assert step == before, f"attempt {attempt} resumed from step {step}, newest complete was {before}"
            resumed_from.append(step)
    assert mid_write_kills >= 1, "no kill landed inside a checkpoint write"
    print(f"kill plan {plan}; resumed from steps {resumed_from}; {mid_write_kills} kills inside a checkpoint write")
    final_log = tmp_path / "final.log"
    assert run_cli(_resume(args), final_log) == 0, _read(final_log)
    _assert_same_as_reference(run, ref)


def test_sigkill_at_ten_random_points_then_resume_matches_uninterrupted_run(setup, tmp_path):
    _kill_test(setup, kills=10, seed=8, tmp_path=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_many_points_slow(setup, tmp_path, seed):
    _kill_test(setup, kills=10, seed=seed, tmp_path=tmp_path)


def test_sigterm_checkpoints_exits_zero_and_resume_continues_exactly(setup, tmp_path):
    root, corpus, ref = setup
    run = tmp_path / "run"
    args = _args(corpus, root / "cache", run)
    log = tmp_path / "first.log"
    proc = start_cli(args, log)
    assert wait_for(lambda: last_logged_step(run) >= 5, 120, proc), _read(log)
    proc.terminate()  # SIGTERM
    proc.join(120)
    text = _read(log)
    assert proc.exitcode == 0, text
    stopped = int(text.split("stopped by SIGTERM after step ")[1].split()[0])
    assert 5 <= stopped < STEPS
    store = CheckpointStore(run / "checkpoints")
    assert store.names()[-1] == f"step_{stopped:08d}" and store.verify(store.names()[-1]) is None
    assert last_logged_step(run) == stopped  # the step in flight was finished, nothing after it started
    assert run_cli(_resume(args), tmp_path / "resume.log") == 0
    resumed = f"resumed from {store.location(f'step_{stopped:08d}')} at step {stopped}"
    assert resumed in (tmp_path / "resume.log").read_text()
    _assert_same_as_reference(run, ref)


def test_second_signal_exits_at_once_and_leaves_no_partial_checkpoint(setup, tmp_path):
    root, corpus, ref = setup
    run = tmp_path / "run"
    args = _args(corpus, root / "cache", run)
    log = tmp_path / "first.log"
    proc = start_cli(args, log, {"MOETRAIN_CKPT_WRITE_DELAY": "0.5"})  # a slow checkpoint write to interrupt
    assert wait_for(lambda: bool(_tmp_dirs(run)), 120, proc), _read(log)
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C: the same graceful stop as SIGTERM
    wait_for(lambda: "SIGINT received" in _read(log), 10, proc)
    os.kill(proc.pid, signal.SIGINT)
    proc.join(10)
    assert proc.exitcode == 128 + signal.SIGINT, _read(log)
    assert "second signal" in _read(log)
    _all_complete_checkpoints_verify(run)
    assert run_cli(_resume(args), tmp_path / "resume.log") == 0, (tmp_path / "resume.log").read_text()
    _assert_same_as_reference(run, ref)


def test_sigkill_while_building_the_data_cache_leaves_nothing_trusted(tmp_path):
    """A kill in the middle of tokenizing: no cache entry exists (it is built in a staging directory and renamed into
    place only when complete), the run directory holds nothing but its lock (data comes first), and the next run
    rebuilds exactly what an undisturbed build produces."""
    big = tmp_path / "big.txt"
    big.write_bytes(sample_text(1_115_394))  # ~1 MB: a few seconds of tokenizer training and tokenizing

    def args(cache: Path, out: Path) -> list[str]:
        return ["train", "--preset", "tiny", "--data", str(big), "--out", str(out), "--no-progress", "--steps", "1",
                f"data.cache_dir={cache}", "train.eval_batches=1", "monitor.tb_heatmap=false"]

    cache, run = tmp_path / "cache", tmp_path / "run"
    log = tmp_path / "killed.log"
    proc = start_cli(args(cache, run), log)
    assert wait_for(lambda: any(cache.glob(".tokens-*.tmp")), 120, proc), _read(log)  # tokenizing has begun
    wait_for(lambda: False, 0.2, proc)
    assert proc.is_alive(), _read(log)
    proc.kill()
    proc.join()
    assert any(cache.glob(".tokens-*.tmp"))
    assert not any(cache.glob("tokens-*")) and sorted(p.name for p in run.iterdir()) == ["train.lock"]
    assert run_cli(args(cache, run), tmp_path / "rerun.log") == 0, _read(tmp_path / "rerun.log")
    assert "reused cached" not in _read(tmp_path / "rerun.log")
    assert not any(cache.glob(".tokens-*.tmp"))  # the killed build's staging directory was removed
    entry = next(cache.glob("tokens-*"))
    assert run_cli(args(tmp_path / "clean", tmp_path / "clean-run"), tmp_path / "clean.log") == 0
    clean = next((tmp_path / "clean").glob("tokens-*"))
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        assert (entry / name).read_bytes() == (clean / name).read_bytes(), name
