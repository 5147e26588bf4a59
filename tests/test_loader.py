"""Background loading (data.workers): the same batches in the same order with or without DataLoader workers, exact
resume from the saved position (bit-for-bit weights after an interrupted run), and data_wait_s reporting."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import sample_text
from moetrain.cli import main
from moetrain.data.batch import PackedBatch
from moetrain.data.dataset import BatchSampler, TokenWindows
from moetrain.data.loader import BatchLoader
from moetrain.data.packing import DocumentBatches, DocumentChunks
from moetrain.train.checkpoint import CheckpointStore

pytestmark = pytest.mark.usefixtures("one_thread")


def _stream(n_docs: int = 60, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([np.concatenate([rng.integers(1, 500, n), [0]])
                           for n in rng.integers(3, 90, n_docs)]).astype(np.uint16)


def _same(a, b) -> bool:
    if isinstance(a, PackedBatch):
        return all(torch.equal(x, y) if x is not None else y is None
                   for x, y in zip((a.inputs, a.targets, a.padding_mask, a.document_ids),
                                   (b.inputs, b.targets, b.padding_mask, b.document_ids)))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _datasets():
    chunks = DocumentChunks(_stream(), 0, 32)
    return {
        "windows": BatchSampler(TokenWindows(_stream(), 16), 4, seed=3),
        "documents": DocumentBatches(chunks, 4, 0, seed=3),
        "budget": DocumentBatches(chunks, 4, 96, seed=3),
    }


@pytest.mark.parametrize("kind", ["windows", "documents", "budget"])
def test_workers_and_resume_give_the_same_batches(kind):
    """40 batches (several epochs of the small stream): workers=2 equal workers=0; a loader resumed from the state
    after batch 17 continues with batch 18, across epoch boundaries."""
    ref = BatchLoader(_datasets()[kind], seed=3)
    want = [ref.next_batch() for _ in range(40)]
    bg = BatchLoader(_datasets()[kind], seed=3, workers=2, prefetch=3)
    got = [bg.next_batch() for _ in range(40)]
    assert all(_same(a, b) for a, b in zip(want, got))
    half = BatchLoader(_datasets()[kind], seed=3, workers=2)
    for _ in range(17):
        half.next_batch()
    state = half.state_dict()  # workers have prefetched beyond batch 17: the state is what was consumed
    resumed = BatchLoader(_datasets()[kind], seed=0, workers=2)
    resumed.load_state_dict(state)
    assert all(_same(resumed.next_batch(), w) for w in want[17:30])
    assert not _same(want[0], want[1])


def test_windows_state_matches_batch_sampler_format():
    """Windows keep the BatchSampler checkpoint format ({'position', 'seed'}), so old checkpoints resume."""
    from moetrain.data.dataset import BatchSampler

    windows = TokenWindows(_stream(), 16)
    old = BatchSampler(windows, 4, 3)
    new = BatchLoader(BatchSampler(windows, 4, 3), seed=3)
    for _ in range(5):
        assert _same(old.next_batch(), new.next_batch())
    assert new.state_dict() == old.state_dict()


def _corpus(path: Path) -> Path:
    """A .jsonl corpus of 300 documents of 5..400 words."""
    words = sample_text(200_000).decode().split()
    rng = np.random.default_rng(0)
    lines, at = [], 0
    for n in rng.integers(5, 400, 300):
        lines.append(json.dumps({"text": " ".join(words[at % 30000 : at % 30000 + n])}))
        at += n
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(corpus: Path, cache: Path, out: Path, steps: int, *extra: str) -> None:
    args = ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--no-progress", "--steps",
            str(steps), f"data.cache_dir={cache}", "data.seq_len=64", "data.packing=documents",
            "train.tokens_per_batch=256", "train.grad_accum=2", "train.log_every=1", "train.ckpt_every=4",
            "train.eval_every=0", "train.eval_batches=1", "monitor.tb_heatmap=false", "monitor.tb_histograms=false",
            *extra]
    assert main(args) == 0


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return CheckpointStore(run / "checkpoints").latest_valid()[0].model_tensors()


def test_interrupted_run_with_workers_resumes_bit_for_bit(tmp_path):
    """Token-budget micro-batches built by 2 workers: a run stopped at step 8 whose last checkpoint is then lost (as
    if killed after the step-4 checkpoint), resumed to step 12, ends with the weights of an uninterrupted run, bit
    for bit, and logged the same losses."""
    corpus = _corpus(tmp_path / "docs.jsonl")
    _train(corpus, tmp_path / "cache", tmp_path / "ref", 12, "data.workers=2")
    # optimizer_state=all: the step-4 checkpoint keeps its AdamW moments, so resuming from it is exact
    _train(corpus, tmp_path / "cache", tmp_path / "run", 12, "data.workers=2", "train.optimizer_state=all",
           "--stop-at-step", "8")
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    assert store.names()[-1].endswith("8")
    store.delete(store.names()[-1])
    _train(corpus, tmp_path / "cache", tmp_path / "run", 12, "data.workers=1", "--resume")  # workers may change
    a, b = _weights(tmp_path / "run"), _weights(tmp_path / "ref")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda run: {r["step"]: r["train_loss"] for r in map(json.loads, (run / "metrics.jsonl").open())
                          if "train_loss" in r}
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    pads = [r["padding_fraction"] for r in map(json.loads, (tmp_path / "ref" / "metrics.jsonl").open())
            if "padding_fraction" in r]
    assert len(pads) == 12 and all(0 <= p < 0.5 for p in pads)


def test_slow_loading_is_reported_as_data_wait(tmp_path, monkeypatch):
    """Every batch takes 0.3 s to build (in the training process): data_wait_s of each logged step (2 micro-batches)
    is at least 0.6 s; it is the time spent in next_batch, not the step's compute."""
    corpus = _corpus(tmp_path / "docs.jsonl")
    build = DocumentBatches.build

    def slow(self, rows):
        time.sleep(0.3)
        return build(self, rows)

    monkeypatch.setattr(DocumentBatches, "build", slow)
    _train(corpus, tmp_path / "cache", tmp_path / "slow", 3, "train.ckpt_every=0")
    waits = [r["data_wait_s"] for r in map(json.loads, (tmp_path / "slow" / "metrics.jsonl").open())
             if "data_wait_s" in r]
    assert len(waits) == 3 and all(w >= 0.6 for w in waits), waits
    monkeypatch.setattr(DocumentBatches, "build", build)
    _train(corpus, tmp_path / "cache", tmp_path / "fast", 3, "train.ckpt_every=0")
    fast = [r["data_wait_s"] for r in map(json.loads, (tmp_path / "fast" / "metrics.jsonl").open())
            if "data_wait_s" in r]
    assert all(w < 0.3 for w in fast[1:]), fast  # step 1 also plans the epoch


def _holders(path: Path) -> set[int]:
    """Processes with ``path`` open (Linux /proc): a `moetrain train` child's stdout and stderr are its log file,
    and every process it starts (DataLoader workers, a forkserver) inherits them."""
    out = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == str(path):
                out.add(int(fd.parts[2]))
        except OSError:
            pass
    return out - {os.getpid()}


def test_a_sigkilled_run_with_workers_resumes_bit_for_bit_and_leaves_no_workers(tmp_path):
    """A real kill: `moetrain train` with data.workers=2 in a child process is SIGKILLed once its step-5
    checkpoint exists (the kill lands mid-run, workers alive). Resumed with --resume, it ends with the weights of an
    uninterrupted run bit for bit and logged the same losses. No process it started outlives it: the killed run's
    DataLoader workers exit on their own, and so do the resumed run's. (The children of _crash_util start with the
    forkserver method, Python 3.14's default on Linux: the workers are then children of the trainer's forkserver,
    which they keep alive, so PyTorch's own watchdog, which watches the parent, never fires; data/loader.py's
    worker_init_fn watches the training process itself.)"""
    import signal

    from _crash_util import losses_by_step, run_cli, start_cli, wait_for

    corpus = _corpus(tmp_path / "docs.jsonl")
    steps = 40

    def argv(out: Path) -> list[str]:
        return ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--no-progress", "--steps",
                str(steps), f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64", "data.packing=documents",
                "train.tokens_per_batch=256", "train.grad_accum=2", "train.log_every=1", "train.ckpt_every=5",
                "train.eval_every=0", "train.eval_batches=1", "train.threads=1", "data.workers=2",
                "monitor.tb_heatmap=false", "monitor.tb_histograms=false"]

    ref_rc = run_cli(argv(tmp_path / "ref"), tmp_path / "ref.log", daemon=False)
    assert ref_rc == 0, (tmp_path / "ref.log").read_text()
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_cli(argv(run), log, daemon=False)
    try:
        assert wait_for(lambda: (run / "checkpoints" / "step_00000005").is_dir(), 300, proc), log.read_text()
        started = _holders(log) - {proc.pid}  # what the trainer started: its 2 workers (and a forkserver)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL
    assert len(started) >= 2, started
    killed_at = max(losses_by_step(run), default=0)
    assert 5 <= killed_at < steps  # killed mid-run, after the step-5 checkpoint
    assert wait_for(lambda: not _holders(log), 30, poll=0.5), _holders(log)  # every one of them exited

    resumed_log = tmp_path / "resume.log"
    assert run_cli([*argv(run), "--resume"], resumed_log, daemon=False) == 0, resumed_log.read_text()
    assert "resumed from" in resumed_log.read_text()
    assert wait_for(lambda: not _holders(resumed_log), 30, poll=0.5), _holders(resumed_log)
    a, b = _weights(run), _weights(tmp_path / "ref")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert losses_by_step(run) == losses_by_step(tmp_path / "ref")
