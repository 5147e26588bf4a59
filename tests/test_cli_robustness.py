"""CLI robustness found by a fresh-user review: one-line errors (exit 2) for bad arguments, no silent overwrites,
a closed pipe exits quietly, ``--version``, ``--config`` files with a ``preset`` key, ``plan``'s default length.

Commands run in-process through ``moetrain.cli.main`` except where a real process matters (a closed stdout pipe).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from conftest import sample_text
from moetrain.cli import main
from moetrain.config import build_config, upgrade
from moetrain.configlib import load_file, parse_overrides
from moetrain.errors import MoetrainError

TINY = ["--no-progress", "train.eval_batches=1", "monitor.tb_heatmap=false"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A corpus, its token cache and a finished 2-step tiny run."""
    root = tmp_path_factory.mktemp("robust")
    corpus = root / "corpus.txt"
    corpus.write_bytes(sample_text(50_000))
    cache = root / "cache"
    run = root / "run"
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--steps", "2",
                 f"data.cache_dir={cache}", *TINY]) == 0
    return {"root": root, "corpus": corpus, "cache": cache, "run": run}


def one_line_error(capsys, argv: list[str], *words: str) -> str:
    """Run ``moetrain ARGV``: exit status 2 and one stderr line holding every word; returns the line."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrain"), err
    assert "Traceback" not in out + err
    for w in words:
        assert str(w) in lines[0], lines[0]
    return lines[0]


# -- 9: a reader that leaves early (`moetrain stats RUN | head -1`) ------------------------------------------------

@pytest.mark.parametrize("argv", [["stats", "{run}"], ["generate", "{run}", "--prompt", "The ", "--max-new-tokens",
                                                        "20"]], ids=["stats", "generate"])
def test_closed_stdout_pipe_exits_quietly(env, argv):
    """The reader closes the pipe before the command prints: no traceback, no 'Exception ignored', status 141
    (128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe)."""
    cmd = [sys.executable, "-m", "moetrain", *[a.format(run=env["run"]) for a in argv]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.stdout.close()  # the reader is gone before the first line is written (imports take seconds)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err


# -- 10: --config files and overrides ------------------------------------------------------------------------------

def test_preset_key_in_a_config_file_applies_the_preset(tmp_path, capsys):
    cfg = tmp_path / "mine.toml"
    cfg.write_text('preset = "tiny"\n[train]\nsteps = 7\n')
    got = build_config(None, load_file(cfg))
    want = build_config("tiny", {"train": {"steps": 7}})  # the preset's values, the file's field on top
    assert got == want and got.model != build_config().model
    # through the CLI: plan counts the tiny model's parameters, not the default preset's
    assert main(["plan", "--config", str(cfg), "--devices", "2"]) == 0
    from_file = capsys.readouterr().out.splitlines()[0]
    assert main(["plan", "--preset", "tiny", "--devices", "2"]) == 0
    assert from_file == capsys.readouterr().out.splitlines()[0]
    # a different --preset next to the file's is ambiguous
    one_line_error(capsys, ["plan", "--preset", "cpu-small", "--config", cfg, "--devices", "2"],
                   "preset:", "'cpu-small'", "'tiny'", "disagree")
    bad = tmp_path / "bad.json"
    bad.write_text('{"preset": "huge"}')
    one_line_error(capsys, ["plan", "--config", bad, "--devices", "2"], "'huge' is not a preset", "tiny")


def test_config_that_is_a_directory_and_empty_override_names(tmp_path, capsys):
    one_line_error(capsys, ["plan", "--config", tmp_path, "--devices", "2"], f"--config {tmp_path}: is a directory")
    for item in ("=3", "model..hidden=3", "model.=3"):
        one_line_error(capsys, ["plan", "--devices", "2", item], f"override '{item}': empty field name")


# -- 5: plan's default sequence length -----------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "mixtral-8x7b"])
def test_plan_default_seq_is_the_context_capped_at_4096(preset, capsys):
    assert main(["plan", "--preset", preset, "--devices", "8"]) == 0
    seq = min(4096, build_config(preset).model.max_seq_len)
    step = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step"))
    assert f"1024 x {seq} tokens" in step, step


# -- 11, 12: small argument checks, --version ----------------------------------------------------------------------

def test_negative_alarm_count_is_refused(env, capsys):
    one_line_error(capsys, ["stats", env["run"], "--alarms", "-1"], "--alarms", "-1")
    assert main(["stats", str(env["run"]), "--alarms", "0"]) == 0


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"moetrain {version('moetrain')}"


# -- 6, 7: export: validated before writing, written whole or not at all, --overwrite replaces only an export -----

def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_bad_shard_size_writes_nothing(env, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    for size in ("banana", "5XB", "0", "-1GB", ""):
        one_line_error(capsys, ["export", env["run"], out, f"--max-shard-size={size}"], "--max-shard-size",
                       repr(size))
    one_line_error(capsys, ["upcycle", tmp_path / "dense", tmp_path / "moe", "--experts", "4", "--top-k", "2",
                            "--max-shard-size", "banana"], "--max-shard-size 'banana'")
    assert list(tmp_path.iterdir()) == []  # no OUT_DIR, no temporary directory


def test_export_overwrite_replaces_only_a_previous_export(env, tmp_path, capsys):
    pytest.importorskip("transformers")
    first = tmp_path / "first"
    # A small shard size gives several shards; the second export (one file) must not leave stale shards behind.
    assert main(["export", str(env["run"]), str(first), "--max-shard-size", "100KB"]) == 0
    assert len(list(first.glob("model-*-of-*.safetensors"))) > 1
    fresh = tmp_path / "fresh"
    assert main(["export", str(env["run"]), str(fresh)]) == 0
    (first / "config.json").write_text("{}")  # mark the old export
    one_line_error(capsys, ["export", env["run"], first], "exists and is not empty", "--overwrite")
    assert main(["export", str(env["run"]), str(first), "--overwrite"]) == 0
    assert _tree(first) == _tree(fresh)  # replaced as a whole: no stale shard, no stale config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "fresh"]  # no temporary directories left

    # A directory that is not an export, or an export with the user's own files in it, is never deleted.
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    one_line_error(capsys, ["export", env["run"], other, "--overwrite"], "does not look like a previous export",
                   "refusing to delete")
    (first / "NOTES.md").write_text("mine")
    before = _tree(first)
    one_line_error(capsys, ["export", env["run"], first, "--overwrite"], "NOTES.md", "refusing to delete")
    assert (other / "precious.txt").read_text() == "keep me" and _tree(first) == before
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line_error(capsys, ["export", env["run"], afile, "--overwrite"], "exists and is not a directory")
    assert afile.read_text() == "x"


# -- 6: report --out -----------------------------------------------------------------------------------------------

def test_report_out_is_not_overwritten_without_overwrite(env, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.html").write_text("an earlier report")
    (out / "mine.txt").write_text("keep me")
    one_line_error(capsys, ["report", env["run"], "--out", out], f"--out {out}: exists and is not empty", "--overwrite")
    assert (out / "report.html").read_text() == "an earlier report"
    assert main(["report", str(env["run"]), "--out", str(out), "--overwrite"]) == 0
    assert (out / "report.html").read_text() != "an earlier report" and (out / "mine.txt").read_text() == "keep me"
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line_error(capsys, ["report", env["run"], "--out", afile], "exists and is not a directory")


# -- 6, 8: bench arguments are checked before the benchmark starts -------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["bta", "--threads", "-1"], ["--threads", "-1"]),
    (["moe", "--threads", "-2"], ["--threads", "-2"]),
    (["train", "--batch", "0"], ["--batch: must be >= 1, got 0"]),
    (["train", "--seq", "1"], ["--seq: must be >= 2", "got 1"]),
    (["train", "--preset", "tiny", "--seq", "{too_long}"], ["--seq: {too_long} exceeds", "preset tiny"]),
    (["moe", "--json", "{tmp}"], ["--json {tmp}: is a directory"]),
    (["bta", "--json", "{tmp}/earlier.json"], ["--json {tmp}/earlier.json: exists", "--overwrite"]),
    (["train", "--json", "{tmp}/earlier.json/x.json"], ["a parent path is a file"]),
    (["train", "--preset", "tiny", "--lr", "-1"], ["--lr: must be > 0 and finite, got -1"]),
    (["train", "--preset", "tiny", "--lr", "nan"], ["--lr: must be > 0 and finite, got nan"]),
], ids=["bta-threads", "moe-threads", "train-batch", "train-seq", "train-seq-context", "json-dir", "json-exists",
        "json-parent", "train-lr-negative", "train-lr-nan"])
def test_bench_argument_errors(tmp_path, capsys, argv, words):
    (tmp_path / "earlier.json").write_text("{}")
    fill = {"tmp": tmp_path, "too_long": build_config("tiny").model.max_seq_len + 1}
    one_line_error(capsys, ["bench", *[a.format(**fill) for a in argv]], *[w.format(**fill) for w in words])
    assert (tmp_path / "earlier.json").read_text() == "{}"


def test_bench_overwrite_replaces_the_json(tmp_path, capsys):
    out = tmp_path / "bta.json"
    out.write_text("{}")
    tiny = ["bench", "bta", "--experts", "4", "--top-k", "2", "--hidden", "16", "--expert-ffn", "8", "--heads", "2",
            "--layers", "1", "--vocab", "32", "--seq", "8", "--batch", "4", "--tiles", "2", "--steps", "1",
            "--warmup", "0", "--json", str(out)]
    assert main([*tiny, "--overwrite"]) == 0
    assert "modes" in out.read_text()


# -- 1: one trainer per run directory ------------------------------------------------------------------------------

def _train(env, run: Path, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--data", str(env["corpus"]), "--out", str(run), f"data.cache_dir={env['cache']}",
            *TINY, *extra]


def test_a_second_trainer_on_a_busy_run_directory_exits_2(env, tmp_path, capsys):
    from _crash_util import start_cli, tree_digest, wait_for

    from moetrain.train.run_lock import RunLock

    run = tmp_path / "busy"
    # Long enough to still be running when the others try (killed below); no checkpoint until the end.
    proc = start_cli(_train(env, run, "--steps", "100000", "train.ckpt_every=0", "train.eval_every=0"),
                     tmp_path / "first.log")
    try:
        assert wait_for(lambda: (run / "metrics.jsonl").exists(), 120, proc), (tmp_path / "first.log").read_text()
        for extra in (["--resume"], ["--overwrite"], []):
            argv = _train(env, run, *extra)
            line = one_line_error(capsys, argv, f"run directory '{run}' is in use by another moetrain train",
                                  f"lock {run / 'train.lock'}")
            assert "--out" in line
        assert proc.is_alive()  # the first trainer was not disturbed, and nothing deleted its directory
        assert (run / "config.json").is_file() and (run / "train.lock").is_file()
    finally:
        proc.kill()
        proc.join()
    before = tree_digest(run)
    with RunLock(run):  # the kernel released the killed holder's lock: a stale lock file blocks nothing
        pass
    assert tree_digest(run) == before


@contextlib.contextmanager
def _lock_held_elsewhere(path: Path):
    """A separate process holds ``RunLock(path)`` inside the block; it is SIGKILLed on exit (no cleanup runs)."""
    code = ("import time\nfrom moetrain.train.run_lock import RunLock\n"
            f"with RunLock({str(path)!r}):\n    print('locked', flush=True)\n    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_lock_holder_does_not_block(tmp_path):
    """A separate process takes the lock and is SIGKILLed: the lock file stays, the lock does not."""
    from moetrain.train.run_lock import RunLock

    run = tmp_path / "run"
    with _lock_held_elsewhere(run):  # killed on exit: no cleanup ran in the holder
        with pytest.raises(MoetrainError, match="is in use by another moetrain train"), RunLock(run):
            pass
    assert (run / "train.lock").exists()
    with RunLock(run):
        pass


def test_overwrite_keeps_a_run_whose_checkpoint_location_holds_checkpoints(env, tmp_path, capsys):
    """--overwrite of a run with an outside train.checkpoint_url deleted the run directory, then the trainer refused
    the location (it holds the old run's checkpoints): the run was lost. Now refused before anything is deleted."""
    run, location = tmp_path / "run", tmp_path / "ckpts"
    argv = _train(env, run, "--steps", "1", f"train.checkpoint_url={location}")
    assert main([str(a) for a in argv]) == 0
    before = sorted(p.name for p in run.iterdir())
    one_line_error(capsys, [*argv, "--overwrite"], f"--overwrite: train.checkpoint_url {location}",
                   "step_00000001", "nothing in")
    assert sorted(p.name for p in run.iterdir()) == before and (run / "config.json").is_file()


def test_two_runs_cannot_share_a_local_checkpoint_url_at_once(env, tmp_path, capsys):
    """Two new runs (different --out) given the same empty local train.checkpoint_url both passed the "already holds
    checkpoints" check and then interleaved their checkpoints there (one run's final write failed, and its --resume
    loaded the other run's step). The location is locked like a run directory while a run uses it."""
    location = tmp_path / "ckpts"
    with _lock_held_elsewhere(location):
        line = one_line_error(capsys, _train(env, tmp_path / "second", "--steps", "1",
                                             f"train.checkpoint_url={location}"),
                              f"train.checkpoint_url: the location '{location}' is in use by another moetrain train",
                              f"lock {location / 'train.lock'}")
        assert "choose another train.checkpoint_url" in line
    assert not (tmp_path / "second").exists()
    assert main(_train(env, tmp_path / "second", "--steps", "1", f"train.checkpoint_url={location}")) == 0
    assert [p.name for p in location.glob("step_*")] == ["step_00000001"]


def test_a_lock_on_a_new_directory_is_removed_when_the_run_fails(env, tmp_path, capsys):
    run = tmp_path / "new" / "run"
    one_line_error(capsys, ["train", "--preset", "tiny", "--data", tmp_path / "nowhere", "--out", run, *TINY],
                   "does not exist")
    assert list(tmp_path.iterdir()) == []  # neither the run directory nor its new parent remain


# -- 2: what --resume may change -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped(env):
    """A tiny run of 8 steps stopped after step 4 (warm-up 5 steps, so the schedule is still rising)."""
    run = env["root"] / "stopped"
    assert main(_train(env, run, "--steps", "8", "--stop-at-step", "4", "train.log_every=1")) == 0
    return run


def _lr_by_step(run: Path) -> dict[int, float]:
    from _crash_util import metrics

    return {r["step"]: r["lr"] for r in metrics(run) if "lr" in r}


def _hand_lr(step: int, lr: float, warmup: int, total: int, lo: float) -> float:
    """The documented schedule by hand for 1-based step ``step``: linear warm-up, then cosine to lo * lr."""
    import math

    i = step - 1
    if i < warmup:
        return lr * (i + 1) / warmup
    return lr * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * min(1.0, (i - warmup) / (total - warmup)))))


@pytest.mark.parametrize("argv, words", [
    (["model.hidden=128"], ["model.hidden: cannot change when resuming", "64", "128"]),
    (["data.seq_len=32"], ["data.seq_len: cannot change when resuming", "64", "32"]),
    (["train.batch_size=4"], ["train.batch_size: cannot change when resuming", "8", "4"]),
    (["train.seed=1"], ["train.seed: cannot change", "0", "1"]),
    (["--steps", "3"], ["train.steps: 3 is below the step of the checkpoint to resume (4"]),
    (["--preset", "cpu-small"], ["--preset cpu-small cannot be combined with --resume", "'tiny'"]),
    (["--config", "{root}/other_preset.toml"], ["preset: cannot change when resuming", "'tiny'", "'cpu-small'"]),
    # tiny leaves the experts' decay unset (null: train.weight_decay): the message says it as a config would
    (["train.expert_weight_decay=1.0"], ["train.expert_weight_decay: cannot change when resuming (the run was "
                                         "trained with null, got 1.0)"]),
], ids=["model", "data", "batch", "seed", "steps-below", "preset-flag", "preset-in-file", "null-value"])
def test_resume_refuses_fixed_fields_and_touches_nothing(env, stopped, capsys, argv, words):
    from _crash_util import tree_digest

    (env["root"] / "other_preset.toml").write_text('preset = "cpu-small"\n')
    before = tree_digest(stopped)
    one_line_error(capsys, ["train", "--out", stopped, "--resume", "--no-progress",
                            *[a.format(root=env["root"]) for a in argv]], *words)
    assert tree_digest(stopped) == before


def test_resume_with_allowed_changes_prints_them_and_the_new_schedule_applies(env, stopped, tmp_path, capsys):
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    saved = json.loads((run / "config.json").read_text())
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--steps", "12", "train.lr=0.001",
                 "train.eval_every=3", "--stop-at-step", "10"]) == 0
    out = capsys.readouterr().out
    changed = [line for line in out.splitlines() if line.startswith("resuming with a changed config")]
    assert changed == [("resuming with a changed config: train.eval_every 15 -> 3, train.lr 0.003 -> 0.001, "
                        "train.steps 8 -> 12 (config.json is rewritten with them)")]
    now = json.loads((run / "config.json").read_text())
    assert now["train"]["steps"] == 12 and now["train"]["lr"] == 0.001 and now["train"]["eval_every"] == 3
    now["train"].update(steps=8, lr=0.003, eval_every=15)
    assert now == saved  # nothing else changed
    t = saved["train"]
    lrs = _lr_by_step(run)
    for step in range(1, 5):  # before the resume: the old schedule
        assert lrs[step] == pytest.approx(_hand_lr(step, 0.003, t["warmup_steps"], 8, t["min_lr_ratio"]), rel=1e-12)
    for step in range(5, 11):  # after: the new lr and the cosine stretched over 12 steps, from the first step on
        assert lrs[step] == pytest.approx(_hand_lr(step, 0.001, t["warmup_steps"], 12, t["min_lr_ratio"]), rel=1e-12)
    assert "stopped after step 10 of 12 (--stop-at-step)" in out


def test_resume_without_changes_rewrites_nothing_and_prints_no_change(env, stopped, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    config_bytes = (run / "config.json").read_bytes()
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--preset", "tiny", "--stop-at-step",
                 "5"]) == 0
    assert "changed config" not in capsys.readouterr().out
    assert (run / "config.json").read_bytes() == config_bytes


# -- 3: --resume of a run that stopped before writing config.json --------------------------------------------------

def test_resume_of_a_run_killed_before_its_config_starts_it_fresh(env, tmp_path, capsys):
    from _crash_util import losses_by_step

    run = tmp_path / "early"
    run.mkdir()
    # What a run killed between taking its lock and writing config.json leaves (the tokenizer is written first).
    (run / "train.lock").write_bytes(b"")
    (run / "tokenizer.json").write_bytes((env["run"] / "tokenizer.json").read_bytes())
    (run / ".config.json.tmp-12345").write_bytes(b"{")
    capsys.readouterr()
    assert main(_train(env, run, "--resume", "--steps", "2")) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "has no config.json" in notes[0] and "from step 0" in notes[0]
    assert not (run / ".config.json.tmp-12345").exists()
    straight = tmp_path / "straight"
    assert main(_train(env, straight, "--steps", "2")) == 0
    assert losses_by_step(run) == losses_by_step(straight)  # the same as a run started there from scratch
    # A directory holding anything else is not taken for a run: the error stays.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    one_line_error(capsys, _train(env, other, "--resume"), f"--resume: {other / 'config.json'} not found")
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


# -- 4, 11, 12, 13: shape-only presets, --stop-at-step, closing hints, train.threads --------------------------------

def test_shape_only_presets_are_not_trained(env, tmp_path, capsys, monkeypatch):
    """A shape preset that does not fit this machine (64 GB free, pretended) is refused with the per-rank figure of
    its sharded training state and the smallest layout the planner finds (parallel/dry_run.py)."""
    from moetrain.presets import SHAPE_ONLY
    from moetrain.runtime import preflight

    monkeypatch.setattr(preflight, "available_memory", lambda device_type="cpu": 64e9)
    for name in SHAPE_ONLY:
        one_line_error(capsys, ["train", "--preset", name, "--out", tmp_path / "x"], f"preset {name}: needs",
                       "GB per rank", "64.0 GB free", "the smallest layout that fits is", "--emit FILE.toml")
    cfg = tmp_path / "big.toml"
    cfg.write_text('preset = "mixtral-8x7b"\n')
    one_line_error(capsys, ["train", "--config", cfg, "--out", tmp_path / "x"], "preset mixtral-8x7b: needs 747.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.toml"]


@pytest.mark.parametrize("value", ["0", "-3"])
def test_stop_at_step_must_be_positive(env, tmp_path, capsys, value):
    one_line_error(capsys, _train(env, tmp_path / "r", f"--stop-at-step={value}"), "--stop-at-step: must be >= 1",
                   value)
    assert list(tmp_path.iterdir()) == []


def test_closing_hints(env, tmp_path, capsys):
    from moetrain.train.trainer import resume_hint

    assert resume_hint(tmp_path, distributed=True).startswith("the same torchrun command with --resume (torchrun")
    assert resume_hint(tmp_path) == f"moetrain train --out {tmp_path} --resume"
    assert resume_hint(tmp_path / "my run") == f"moetrain train --out '{tmp_path}/my run' --resume"  # pasteable
    capsys.readouterr()
    assert main(_train(env, tmp_path / "r s", "--steps", "1")) == 0
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done: 1 steps") and "'def '" not in done  # the corpus is English, not Python
    assert f"moetrain generate '{tmp_path}/r s' --prompt" in done


def test_train_threads_sets_the_intra_op_threads(env, tmp_path, capsys):
    from moetrain.train.config import TrainConfig

    with pytest.raises(Exception, match="threads: must be >= 0, got -1"):
        TrainConfig(threads=-1)
    one_line_error(capsys, _train(env, tmp_path / "bad", "train.threads=-1"), "train.threads: must be >= 0, got -1")
    torch.set_num_threads(2)
    try:
        assert main(_train(env, tmp_path / "r", "--steps", "1", "train.threads=1")) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)


def test_resume_may_switch_execution_choices_that_keep_the_maths(env, stopped, tmp_path, capsys):
    # Recomputed experts, BTA tiles and the expert backend change memory and speed, not the result: a resumed run
    # may switch them (e.g. to fit memory), and the losses equal a run resumed without the switch.
    import json
    import shutil

    losses = {}
    for name, extra in (("same", []), ("switched", ["model.execution.recompute_experts=true",
                                                    "model.execution.bta_tiles=2",
                                                    "model.execution.moe_backend=loop"])):
        run = tmp_path / name
        shutil.copytree(stopped, run)
        capsys.readouterr()
        assert main(["train", "--out", str(run), "--resume", "--no-progress", "--stop-at-step", "6", *extra]) == 0
        out = capsys.readouterr().out
        assert ("resuming with a changed config" in out) == bool(extra)
        if extra:  # the values as a config writes them, not Python's True / False
            assert "model.execution.recompute_experts false -> true" in out, out
            assert "model.execution.moe_backend 'fused' -> 'loop'" in out, out
        losses[name] = [r["train_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                        if r.get("step", 0) > 4 and "train_loss" in r]
    assert losses["same"] and losses["switched"] == pytest.approx(losses["same"], rel=1e-5)


def test_a_fresh_run_directory_gets_no_restart_note(env, tmp_path, capsys):
    run = tmp_path / "fresh"
    assert main([*_train(env, run), "--no-progress", "--steps", "1"]) == 0
    assert "stopped before writing" not in capsys.readouterr().out


# -- 11: where the config fields are: --help points to --list-fields ------------------------------------------------

def test_train_help_shows_how_to_set_fields_with_an_example_that_runs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "FIELD=VALUE" in help_text and "moetrain train --list-fields" in help_text
    example = next(line.split() for line in help_text.splitlines() if line.strip().startswith("moetrain train --pre"))
    assert "train.steps=100" in example and "model.moe_every=0" in example
    assert main([*example[1:], "--dry-run"]) == 0  # the example is a valid command
    assert "dry run: the config is valid" in capsys.readouterr().out


def test_list_fields_prints_every_field_with_its_value_type_and_description(capsys):
    import dataclasses

    from moetrain.config import Config
    from moetrain.config_docs import field_docs, nested_configs, sections

    assert main(["train", "--list-fields", "--preset", "tiny", "train.steps=7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("config fields of preset 'tiny'") and "docs/configuration.md" in lines[0]
    by_path = {line.split(" = ")[0]: line for line in lines[1:]}
    want = [f"{path}.{f.name}" for path, cls in sections(Config) if path for f in dataclasses.fields(cls)
            if f.name not in nested_configs(cls)]
    assert list(by_path) == want and len(lines) == len(want) + 1  # every field, once, in declaration order
    assert by_path["train.steps"].split() == ["train.steps", "=", "7", "(int)", "optimizer", "steps", "of", "the",
                                               "whole", "run", "(the", "LR", "schedule", "spans", "these)."]
    assert by_path["model.hidden"].split()[:4] == ["model.hidden", "=", "64", "(int)"]
    assert by_path["model.hidden"].endswith(field_docs(build_config("tiny").model.__class__)["hidden"])
    # tiny leaves the experts' decay unset, cpu-small sets it: the value is the selected preset's, null for None
    assert by_path["train.expert_weight_decay"].split()[:6] == ["train.expert_weight_decay", "=", "null", "(float",
                                                                "or", "null)"]
    # types as a user writes values, not as Python annotations
    assert "(one of none / head / full)" in by_path["model.qk_norm"]
    assert "(list, each one of dead_expert / collapse / token_drop / loss_spike / nonfinite_loss)" in by_path[
        "monitor.fatal"]
    assert by_path["train.deterministic"].split()[:3] == ["train.deterministic", "=", "true"]
    assert by_path["train.dtype"].split()[:3] == ["train.dtype", "=", "'fp32'"]
    assert main(["train", "--list-fields"]) == 0
    assert "train.expert_weight_decay = 1.0 " in capsys.readouterr().out


def test_dry_run_of_a_resumed_run_writes_nothing(env, tmp_path, capsys):
    """--resume --dry-run checks the run's own config (with this command's changes) and trains nothing."""
    import shutil

    from _crash_util import tree_digest

    run = tmp_path / "resumed"
    shutil.copytree(env["run"], run)
    before = tree_digest(run)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--dry-run", "--world-size", "2", "--steps", "4",
                 "parallel.ep=2"]) == 0
    out = capsys.readouterr().out
    assert "resuming would change the config: parallel.ep 1 -> 2, train.steps 2 -> 4" in out
    assert f"dry run: the resumed run {run}'s config is valid for 2 rank(s); nothing was written" in out
    assert "routed experts" in out or "matrices (with the routers and routed experts)" in out  # the AdamW groups
    assert tree_digest(run) == before  # no step trained, no checkpoint, config.json unchanged
    # fewer steps than the checkpoint's: the real run refuses it, so the dry run must not call it valid
    one_line_error(capsys, ["train", "--out", run, "--resume", "--dry-run", "--steps", "1"],
                   "train.steps: 1 is below the step of the newest checkpoint to resume (2,", "give at least 2")
    assert tree_digest(run) == before


@pytest.mark.parametrize("flag", [["--resume", "--out", "RUN"], ["--init-from", "RUN"], ["--dry-run"]])
def test_list_fields_refuses_flags_it_would_ignore(env, capsys, flag):
    argv = ["train", "--list-fields", *[str(env["run"]) if a == "RUN" else a for a in flag]]
    one_line_error(capsys, argv, f"--list-fields lists a preset's fields and does not combine with {flag[0]}")


def test_the_choice_none_can_be_typed_as_an_override(capsys):
    """`none` reads as null in an override; a field whose choices hold 'none' takes it as that choice."""
    assert build_config("tiny", overrides=upgrade(parse_overrides(["model.qk_norm=none"]))).model.qk_norm == "none"
    assert main(["train", "--list-fields", "--preset", "tiny", "model.qk_norm=none"]) == 0
    assert "model.qk_norm = 'none'" in capsys.readouterr().out


# -- deployment review: serve / generate / eval / stats arguments ---------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--threads", "0"], ["--threads", "0"]),  # was torch's RuntimeError traceback
    (["--port", "99999"], ["--port", "99999"]),  # was uvicorn's OverflowError traceback, then an error
    (["--port", "-5"], ["--port", "-5"]),
    (["--routing", "threshold", "--threshold", "0"], ["--threshold", "0"]),  # was named "--p"
    (["--routing", "load", "--load-low", "5", "--load-high", "2"], ["--load-low", "--load-high", "5", "2"]),
    (["--top-k", "9"], ["--top-k", "9"]),  # was named "--k"
    # flags the chosen policy never reads (they did nothing)
    (["--routing", "threshold", "--top-k", "1"], ["--top-k", "the fixed"]),
    (["--threshold", "0.5"], ["--threshold", "the threshold"]),
    (["--k-max", "1"], ["--k-max", "the threshold"]),
    (["--routing", "threshold", "--load-high", "9"], ["--load-high", "the load"]),
    (["--hot-share", "0.2"], ["--hot-share", "--expert-memory-budget"]),
    (["--calibration-text", "notes.txt"], ["--calibration-text", "--expert-memory-budget"]),
    (["--max-connections", "0"], ["--max-connections", "0"]),
    (["--header-timeout", "0"], ["--header-timeout", "0"]),
    (["--read-timeout", "nan"], ["--read-timeout", "nan"]),
])
def test_serve_argument_errors_name_the_flag(env, capsys, argv, words):
    one_line_error(capsys, ["serve", env["run"], "--port", "0", *argv], *words)


def test_serve_on_a_taken_port_says_so_before_loading(env, capsys, monkeypatch):
    """A port in use (or an address not this machine's) is a one-line error before the model loads."""
    import socket

    from moetrain.commands import serve as serve_cmd

    monkeypatch.setattr(serve_cmd, "build_engine", lambda *a: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(capsys, ["serve", env["run"], "--port", port], "--port", str(port), "in use")


def test_generate_seed_out_of_range_is_one_line(env, capsys):
    one_line_error(capsys, ["generate", env["run"], "--prompt", "x", "--seed", str(2**70)], "--seed", str(2**70))


def test_generate_and_eval_on_a_hugging_face_directory_say_so(env, tmp_path, capsys):
    """An export is not a run directory: the error names the directory and what it is (was 'architectures: unknown
    config key; known fields: [...]')."""
    hf = tmp_path / "hf"
    assert main(["export", str(env["run"]), str(hf)]) == 0
    for argv in (["generate", hf, "--prompt", "x"], ["eval", hf]):
        one_line_error(capsys, argv, str(hf), "Hugging Face", "moetrain serve")


def test_stats_of_a_run_without_metrics_says_none_logged(env, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_bytes((env["run"] / "config.json").read_bytes())
    assert main(["stats", str(run)]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "steps logged: none of 2" in out, out


def test_stats_of_a_run_without_the_routing_monitor_says_it_was_off(env, tmp_path, capsys):
    """monitor.enabled=false: stats said "alarms: none" and "no routing statistics logged yet" of a finished run,
    as if its routing had been checked and found healthy."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    config = json.loads((env["run"] / "config.json").read_text())
    config["monitor"]["enabled"] = False
    (run / "config.json").write_text(json.dumps(config))
    (run / "metrics.jsonl").write_text('{"step": 2, "train_loss": 5.0}\n')
    assert main(["stats", str(run)]) == 0
    out = capsys.readouterr().out
    assert "alarms: not evaluated (monitor.enabled=false)" in out, out
    assert "no routing statistics: the routing monitor was off (monitor.enabled=false)" in out, out
    assert "logged yet" not in out


@pytest.mark.parametrize("flag, value", [
    ("--temperature", "inf"),  # was accepted, sampling uniformly (serve refuses it)
    ("--temperature", "nan"),
    ("--temperature", "-1"),
    ("--top-p", "nan"),
    ("--top-p", "0"),
    ("--top-p", "1.5"),
])
def test_generate_refuses_non_finite_or_out_of_range_sampling_flags(env, capsys, flag, value):
    one_line_error(capsys, ["generate", env["run"], "--prompt", "x", flag, value], flag, value)


def test_stats_on_a_hugging_face_export_says_so(env, tmp_path, capsys):
    """An export's config.json is not a run's: stats said so in one line (was a partial summary, exit 0)."""
    hf = tmp_path / "hf"
    assert main(["export", str(env["run"]), str(hf)]) == 0
    for command in ("stats", "report"):  # report wrote an almost empty report, exit 0
        one_line_error(capsys, [command, hf], str(hf), "Hugging Face", "not a moetrain run directory")
    assert not (hf / "report").exists()
