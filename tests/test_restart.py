"""What a resume records about lost work, and the torchrun restart detection of ``moetrain train`` (one process,
``TORCHELASTIC_RESTART_COUNT`` set as torchrun's agent sets it; the real restarts are in test_elastic.py)."""

from __future__ import annotations

import json

import pytest

from moetrain.cli import main
from moetrain.train.restart import RESTART_ENV, last_logged_step, resume_record


def test_resume_record():
    assert resume_record(4, 4, 0) is None  # a planned stop and --resume: nothing lost, nothing to say
    assert resume_record(4, None, 0) is None
    assert resume_record(4, 7, 0) == {"step": 4, "event": "resume", "resumed_from_step": 4, "lost_steps": 3,
                                      "last_logged_step": 7, "torchrun_restart": 0}
    assert resume_record(0, None, 2)["lost_steps"] == 0  # restarted before the first logged step


def test_last_logged_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_logged_step(path) is None
    path.write_text('{"step": 0, "val_loss": 6.0}\n{"step": 1, "train_loss": 5.0}\n{"step": 2, "train_loss": 4.')
    assert last_logged_step(path) == 1  # the line cut short by a crash is skipped


def test_a_torchrun_restart_resumes_by_itself(tmp_path, code_corpus, monkeypatch, capsys):
    args = ["train", "--preset", "tiny", "--data", str(code_corpus), "--out", str(tmp_path / "run"), "--no-progress",
            f"data.cache_dir={tmp_path / 'cache'}", "train.steps=3", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=1", "train.ckpt_every=1", "--overwrite"]
    assert main([*args, "--stop-at-step", "2"]) == 0
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    # the process died after logging step 2 but before its checkpoint: step 2's checkpoint is gone
    import shutil
    shutil.rmtree(sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1])
    monkeypatch.setenv(RESTART_ENV, "1")
    assert main(args) == 0  # the same command (--overwrite included): continued, not deleted
    out = capsys.readouterr().out
    assert "torchrun restart 1" in out and "resumed at step 1: 1 logged step(s) after it were lost" in out
    after = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert after[:2] == [json.loads(line) for line in records[:2]]  # step 0 and step 1 kept
    assert [r["step"] for r in after if "train_loss" in r] == [1, 2, 3]
    assert [r for r in after if r.get("event")] == [{"step": 1, "event": "resume", "resumed_from_step": 1,
                                                      "lost_steps": 1, "last_logged_step": 2, "torchrun_restart": 1}]


def test_a_restart_needs_out(monkeypatch, capsys):
    monkeypatch.setenv(RESTART_ENV, "1")
    assert main(["train", "--preset", "tiny"]) == 2
    assert "has no --out" in capsys.readouterr().err
