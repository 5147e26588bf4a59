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
