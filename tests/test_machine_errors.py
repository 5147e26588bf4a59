"""Errors from the machine and sizes that cannot fit (issue 20): a damaged tokenizer.json, a read-only --out, a
full disk at a checkpoint write (injected ENOSPC), absurd sizes, --overwrite of a non-run, --resume of a directory
that does not exist yet, and what is printed when. Each is one line, exit status 2, no traceback, and nothing that
existed before is changed (hashed before and after)."""

from __future__ import annotations

import errno
import hashlib
import pathlib
import shutil
import threading
from pathlib import Path

import pytest

from _crash_util import metrics, tree_digest
from conftest import sample_text
from moetrain.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("machine")
    corpus = root / "corpus.txt"
    corpus.write_bytes(sample_text(50_000))
    cache = root / "cache"
    run = root / "run"
    assert main([*_train(corpus, cache, run), "--steps", "2"]) == 0
    return {"root": root, "corpus": corpus, "cache": cache, "run": run}


def _train(corpus: Path, cache: Path, out: Path) -> list[str]:
    return ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--no-progress",
            f"data.cache_dir={cache}", "train.eval_batches=1", "train.threads=1"]


def _one_line(capsys, argv: list[str]) -> tuple[str, str]:
    """Run the CLI; assert exit 2, one stderr line starting 'moetrain: error:', no traceback; (line, stdout)."""
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), err
    assert "Traceback" not in out + err
    return lines[0], out


@pytest.mark.parametrize("command", ["generate", "eval", "export"])
def test_a_damaged_tokenizer_is_one_line(env, tmp_path, capsys, command):
    run = tmp_path / "run"
    shutil.copytree(env["run"], run)
    (run / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')  # cut short
    before = tree_digest(run)
    argv = {"generate": ["generate", str(run), "--prompt", "a", "--max-new-tokens", "2"],
            "eval": ["eval", str(run)],
            "export": ["export", str(run), str(tmp_path / "hf")]}[command]
    line, _ = _one_line(capsys, argv)
    assert f"cannot load tokenizer '{run / 'tokenizer.json'}'" in line
    assert tree_digest(run) == before and not (tmp_path / "hf").exists()


def _read_only_under(monkeypatch, root: Path) -> None:
    """Path.mkdir under ``root`` fails as on a read-only file system."""
    real = pathlib.Path.mkdir

    def mkdir(self, *a, **k):
        if str(self).startswith(str(root)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)


def test_a_read_only_out_is_one_line_naming_the_path(env, tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    _read_only_under(monkeypatch, ro)
    line, out = _one_line(capsys, _train(env["corpus"], env["cache"], ro / "a" / "run"))
    assert f"cannot write the run directory ({ro / 'a'}): Read-only file system" in line
    assert "the file system is read-only; choose another --out" in line
    assert "run directory:" not in out
    assert list(ro.iterdir()) == []


def test_any_other_os_error_is_one_line_too(capsys, monkeypatch):
    """The CLI's last resort: an OSError nobody wrapped still gives the path and the reason, exit 2."""
    import moetrain.commands.stats as stats

    def boom(args):
        raise PermissionError(errno.EACCES, "Permission denied", "/some/where/metrics.jsonl")

    monkeypatch.setattr(stats, "run", boom)  # add_parser binds func=run when the parser is built, in main
    line, _ = _one_line(capsys, ["stats", "whatever"])
    assert line == ("moetrain: error: /some/where/metrics.jsonl: Permission denied; no permission; choose another "
                    "--out or fix the permissions")


def _run_files(run: Path) -> dict[str, str]:
    """SHA-256 of config.json, metrics.jsonl, tokenizer.json and of every file of every finished checkpoint."""
    files = [run / name for name in ("config.json", "metrics.jsonl", "tokenizer.json")]
    files += [p for d in sorted((run / "checkpoints").glob("step_*")) for p in sorted(d.rglob("*")) if p.is_file()]
    assert all(p.is_file() for p in files[:3])
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_a_full_disk_at_a_checkpoint_leaves_the_earlier_ones_intact(env, tmp_path, monkeypatch, capsys):
    """A resumed run (2 -> 6 steps, a checkpoint every 2) whose disk fills while step 4's checkpoint is written:
    config.json, metrics.jsonl, tokenizer.json and the earlier checkpoint (step 2) are hashed right before the
    ENOSPC (so after this run's own writes: config.json with train.steps=6, metrics of steps 3-4) and are
    byte-identical afterwards: the failed write changed nothing, and nothing was written after it."""
    run = tmp_path / "run"
    shutil.copytree(env["run"], run)  # a finished 2-step run with its checkpoint step_00000002
    ckpts = run / "checkpoints"
    import moetrain.train.checkpoint as checkpoint

    before: dict[str, str] = {}

    def full_disk() -> None:  # called after each file of a checkpoint is written: the disk fills during step 4's
        if list(ckpts.glob(".tmp-step_00000004-*")):
            if not before:
                before.update(_run_files(run))
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_delay", full_disk)
    argv = [*_train(env["corpus"], env["cache"], run), "--resume", "--steps", "6", "train.ckpt_every=2",
            "train.log_every=1"]
    line, out = _one_line(capsys, argv)
    assert "cannot write checkpoint step_00000004" in line and "No space left on device" in line
    assert "free some space" in line
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["step_00000002"]  # no .tmp-step_* left, nothing newer half-written
    assert any(name.startswith("checkpoints/step_00000002/") for name in before)
    assert [r["step"] for r in metrics(run) if "train_loss" in r] == [2, 3, 4]  # step 4 was logged before its checkpoint
    assert _run_files(run) == before
    # and the run continues from it once there is space again
    monkeypatch.undo()
    capsys.readouterr()
    assert main(argv) == 0
    assert "resumed from" in capsys.readouterr().out


def test_a_full_disk_at_a_metrics_write_is_one_line_naming_the_file(env, tmp_path, monkeypatch, capsys):
    """A full disk while a logging step appends to metrics.jsonl: the buffered write's ENOSPC carries no file name
    (found with a 3 MB tmpfs), so the line must name the file itself, not just 'OSError: No space left on device'."""
    run = tmp_path / "run"
    import builtins

    import moetrain.train.metrics as metrics_module

    def full_open(file, mode="r", *args, **kwargs):
        if Path(file).name == "metrics.jsonl" and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(metrics_module, "open", full_open, raising=False)
    line, _ = _one_line(capsys, [*_train(env["corpus"], env["cache"], run), "--steps", "2", "train.log_every=1"])
    assert f"({run / 'metrics.jsonl'})" in line and "No space left on device" in line, line


def test_a_background_writer_error_is_one_line(capsys):
    """TensorBoard's writer thread failing on a full disk: one warning line, not a thread traceback."""
    from moetrain.runtime.oserrors import quiet_thread_os_errors

    old = threading.excepthook
    try:
        quiet_thread_os_errors()

        def write():
            raise OSError(errno.ENOSPC, "No space left on device", "/run/tb/events.out")

        t = threading.Thread(target=write, name="tb-writer")
        t.start()
        t.join()
    finally:
        threading.excepthook = old
    err = capsys.readouterr().err
    assert err.strip() == ("moetrain: warning: tb-writer: /run/tb/events.out: No space left on device; free some "
                           "space or choose another --out")


@pytest.mark.parametrize("field, value, words", [
    ("model.hidden", "1099511627776", ["model.hidden: the model (model.hidden=1099511627776", "for weights, "
                                       "gradients and AdamW state", "free"]),
    ("train.batch_size", "1000000000", ["train.batch_size: one micro-batch of 1000000000 x data.seq_len=64 tokens "
                                        "needs about", "TB of activations", "lower train.batch_size"]),
])
def test_sizes_that_cannot_fit_are_refused_before_allocation(env, tmp_path, capsys, field, value, words):
    new = tmp_path / "new"
    line, out = _one_line(capsys, [*_train(env["corpus"], env["cache"], new), f"{field}={value}"])
    for w in words:
        assert w in line
    assert not new.exists() and "run directory:" not in out
    # the corrected retry is not refused as "already exists"
    assert main([*_train(env["corpus"], env["cache"], new), "--steps", "1"]) == 0


def test_the_estimate_is_what_the_analysis_module_computes():
    """The refusal compares analysis' parameter + activation bytes with free memory; tiny fits, 2 PB does not."""
    from moetrain.analysis.params import count_params
    from moetrain.analysis.shape import ModelShape
    from moetrain.config import build_config
    from moetrain.errors import ConfigError
    from moetrain.runtime.preflight import check_fits, estimate_memory

    cfg = build_config("tiny", None, {})
    est = estimate_memory(cfg)
    assert est.state == 16 * count_params(ModelShape.from_config(cfg.model)).total  # fp32 w + g + 2 AdamW moments
    assert check_fits(cfg, free=est.total) == est
    with pytest.raises(ConfigError, match="train.batch_size|model.hidden"):
        check_fits(cfg, free=est.total - 1)


def test_overwrite_of_a_directory_that_is_not_a_run_leaves_it_as_it_was(env, tmp_path, capsys):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "todo.txt").write_text("keep me")
    before = tree_digest(d)
    line, _ = _one_line(capsys, [*_train(env["corpus"], env["cache"], d), "--overwrite"])
    assert "is not a moetrain run directory" in line
    assert tree_digest(d) == before and sorted(p.name for p in d.iterdir()) == ["todo.txt"]  # no train.lock


def test_resume_of_a_directory_that_does_not_exist_yet_starts_the_run(env, tmp_path, capsys):
    """A restart loop (`until moetrain train --out RUN --resume; do :; done`) killed before RUN existed."""
    run = tmp_path / "loop"
    argv = [*_train(env["corpus"], env["cache"], run), "--resume", "--steps", "2"]
    capsys.readouterr()
    assert main([*argv, "--stop-at-step", "1"]) == 0
    out = capsys.readouterr().out
    assert f"note: {run} does not exist yet, so there is nothing to resume: starting a new run there" in out
    assert main(argv) == 0
    assert f"resumed from {run / 'checkpoints' / 'step_00000001'}" in capsys.readouterr().out


def test_nothing_is_announced_before_a_refusal(env, tmp_path, capsys):
    """'run directory: X' and 'resuming with a changed config ... (config.json is rewritten ...)' come only after
    every check passed: a resume that is then refused (train.steps below the checkpoint) prints neither."""
    run = tmp_path / "run"
    shutil.copytree(env["run"], run)
    before = tree_digest(run)
    line, out = _one_line(capsys, [*_train(env["corpus"], env["cache"], run), "--resume", "--steps", "1",
                                   "train.lr=1e-3"])
    assert "train.steps: 1 is below the step of the checkpoint to resume" in line
    assert "run directory:" not in out and "resuming with a changed config" not in out
    assert tree_digest(run) == before
    capsys.readouterr()
    assert main([*_train(env["corpus"], env["cache"], run), "--resume", "--steps", "3", "train.lr=1e-3"]) == 0
    out = capsys.readouterr().out.splitlines()
    where = next(i for i, s in enumerate(out) if s == f"run directory: {run}")
    assert out[where + 1].startswith("resuming with a changed config: train.lr")
