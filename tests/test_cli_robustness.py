"""CLI robustness found by a fresh-user review: one-line errors (exit 2) for bad arguments, no silent overwrites,
a closed pipe exits quietly, ``--version``, ``--config`` files with a ``preset`` key, ``plan``'s default length.

Commands run in-process through ``moetrain.cli.main`` except where a real process matters (a closed stdout pipe).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from conftest import sample_text
from moetrain.cli import main
from moetrain.config import build_config
from moetrain.configlib import load_file

TINY = ["--no-progress", "train.eval_batches=1", "monitor.tb_heatmap=false"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread (see test_resume.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
], ids=["bta-threads", "moe-threads", "train-batch", "train-seq", "train-seq-context", "json-dir", "json-exists",
        "json-parent"])
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
