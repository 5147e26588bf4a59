"""Bad input: every CLI and config error is one line naming the field or file and the problem, exit status 2,
no traceback, and no change to an existing run directory (hashed before and after every case)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from _crash_util import run_cli, tree_digest
from conftest import sample_text
from moetrain.cli import main
from moetrain.errors import MoetrainError


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Inputs for the cases: a corpus, a finished tiny run (2 steps, with checkpoints), bad corpora and configs."""
    root = tmp_path_factory.mktemp("bad")
    corpus = root / "corpus.txt"
    corpus.write_bytes(sample_text(50_000))
    cache = root / "cache"
    run = root / "run"
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--no-progress",
                 "--steps", "2", f"data.cache_dir={cache}", "train.ckpt_every=1", "train.eval_batches=1",
                 "monitor.tb_heatmap=false"]) == 0
    (root / "empty").mkdir()
    (root / "binary").mkdir()
    for i in range(2):
        (root / "binary" / f"blob{i}.bin").write_bytes(bytes(range(256)) * 4)
    (root / "short.txt").write_text("def f(): pass\n")
    (root / "schema.jsonl").write_text('{"content": "a"}\n{"content": "b"}\n{"content": "c"}\n')
    (root / "bad.toml").write_text("[train\nlr = 1\n")
    (root / "cfg.yaml").write_text("train: {lr: 1}\n")
    (root / "unknown.toml").write_text("[train]\nlearning_rate = 1e-3\n")
    (root / "notrun").mkdir()
    return {"root": root, "corpus": corpus, "cache": cache, "run": run}


# (id, argv template, expected part of the one-line message). Templates: {corpus} {cache} {run} {new} {root}.
T = ["train", "--preset", "tiny", "--data", "{corpus}", "--out", "{new}", "--no-progress", "data.cache_dir={cache}"]
R = ["train", "--out", "{run}", "--resume", "--no-progress"]
CASES = [
    ("unknown-key", [*T, "model.moe.num_expert=4"],
     "model.moe.num_expert: unknown config key; did you mean 'model.moe.num_experts'?"),
    ("unknown-section", [*T, "trian.lr=1"], "trian: unknown config key; did you mean 'train'?"),
    ("unknown-key-in-file", [*T, "--config", "{root}/unknown.toml"], "train.learning_rate: unknown config key"),
    ("int-type", [*T, "train.steps=1.5"], "train.steps: expected an integer, got 1.5"),
    ("float-type", [*T, "train.lr=fast"], "train.lr: expected a number, got 'fast'"),
    ("bool-type", [*T, "train.deterministic=2"], "train.deterministic: expected true or false, got 2"),
    ("choice", [*T, "train.dtype=fp16"], "train.dtype: must be one of ['fp32', 'bf16'], got 'fp16'"),
    ("table-type", [*T, "model.moe=3"], "model.moe: expected a table of fields, got 3"),
    ("topk-gt-experts", [*T, "model.moe.top_k=8"],
     "model.moe.top_k: top-k (8) cannot be larger than the number of experts (4)"),
    ("ep-not-dividing", [*T, "parallel.ep=3"],
     "parallel.ep: expert-parallel size 3 does not divide model.moe.num_experts=4"),
    ("bta-not-dividing", [*T, "model.execution.bta_tiles=3"],
     "model.execution.bta_tiles: 3 attention tiles do not divide the micro-batch train.batch_size=8"),
    ("capacity-zero", [*T, "model.moe.capacity.factor=0"], "model.moe.capacity.factor: must be > 0"),
    ("capacity-negative", [*T, "model.moe.capacity.factor=-1.5"], "model.moe.capacity.factor: must be > 0"),
    ("heads", [*T, "model.hidden=66"],
     "model.hidden: hidden size 66 is not divisible by the number of heads n_heads=4"),
    ("kv-heads", [*T, "model.n_kv_heads=3"], "model.n_kv_heads: n_heads=4 is not divisible by n_kv_heads=3"),
    ("seq-too-long", [*T, "data.seq_len=1000"], "data.seq_len: sequence length 1000 exceeds model.max_seq_len=128"),
    ("negative-lr", [*T, "train.lr=-1"], "train.lr: must be > 0 and finite, got -1.0"),
    ("infinite-lr", [*T, "train.lr=1e400"], "train.lr: must be > 0 and finite, got inf"),
    ("infinite-router-lr", [*T, "train.router_lr_scale=Infinity"],
     "train.router_lr_scale: must be > 0 and finite, got inf"),
    ("zero-steps", [*T, "--steps", "0"], "train.steps: must be >= 1, got 0"),
    ("keep-zero", [*T, "train.keep_checkpoints=0"], "train.keep_checkpoints: must be >= 1, got 0"),
    ("skips-zero", [*T, "train.max_nonfinite_skips=0"], "train.max_nonfinite_skips: must be >= 1, got 0"),
    ("vocab-small", [*T, "model.vocab_size=100"], "model.vocab_size: must be >= 257"),
    ("ckpt-url", [*T, "train.checkpoint_url=bogus://x"],
     "train.checkpoint_url: unknown storage protocol in 'bogus://x'"),
    ("resume-and-overwrite", [*R, "--overwrite"],
     "--resume continues the run in --out and --overwrite deletes it first; pass one of them"),
    ("milestone-not-multiple", [*T, "train.ckpt_every=2", "train.milestone_every=3"],
     "train.milestone_every: must be a multiple of train.ckpt_every (2), got 3"),
    ("milestone-no-ckpts", [*T, "train.ckpt_every=0", "train.milestone_every=4"],
     "train.milestone_every: must be a multiple of train.ckpt_every (0), got 4"),
    ("ckpt-url-relative", [*T, "train.checkpoint_url=ckpts"],
     "train.checkpoint_url: 'ckpts' is a relative path, which resolves against the directory each command is "
     "started from"),
    ("ckpt-url-in-use", [*T, "train.checkpoint_url={run}/checkpoints"],
     "train.checkpoint_url: {run}/checkpoints already holds checkpoints (step_00000002 ...) of another run"),
    ("steps-not-int", [*T, "--steps", "ten"], "moetrain train: error: argument --steps: invalid int value: 'ten'"),
    ("stop-not-int", [*T, "--stop-at-step", "1e3"], "argument --stop-at-step: invalid int value: '1e3'"),
    ("unknown-flag", [*T, "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("unknown-command", ["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
    ("override-syntax", [*T, "lr"], "override 'lr': expected FIELD=VALUE, e.g. model.moe.top_k=1"),
    ("unknown-preset", ["train", "--preset", "huge", "--out", "{new}"], "--preset huge: unknown preset; choose one"),
    ("config-missing", [*T, "--config", "{root}/nope.toml"], "--config {root}/nope.toml: no such file"),
    ("config-syntax", [*T, "--config", "{root}/bad.toml"], "--config {root}/bad.toml: cannot parse:"),
    ("config-suffix", [*T, "--config", "{root}/cfg.yaml"], "--config {root}/cfg.yaml: expected a .toml or .json"),
    ("data-missing", [*T[:4], "{root}/nowhere", *T[5:]], "data path '{root}/nowhere' does not exist"),
    ("data-empty-dir", [*T[:4], "{root}/empty", *T[5:]], "data path '{root}/empty' contains no files"),
    ("data-binary", [*T[:4], "{root}/binary", *T[5:]],
     "no usable text in '{root}/binary': 2 files, 2 skipped (2 binary)"),
    ("data-schema", [*T[:4], "{root}/schema.jsonl", *T[5:]],
     "no usable text in '{root}/schema.jsonl': 3 of 3 lines are not JSON objects with a string 'text' field"),
    ("data-too-short", [*T[:4], "{root}/short.txt", *T[5:]],
     "corpus '{root}/short.txt' is shorter than one sequence of data.seq_len=64 tokens (at most 14 training tokens, need 65)"),
    ("run-exists", [*T[:6], "{run}", *T[7:]], "run directory '{run}' already exists; pass --resume to continue it"),
    ("resume-no-out", ["train", "--resume"], "--resume needs --out RUN_DIR"),
    ("resume-not-a-run", ["train", "--out", "{root}/notrun", "--resume"],
     "--resume: {root}/notrun/config.json not found; is '{root}/notrun' a moetrain run directory?"),
    ("resume-with-preset", [*R, "--preset", "cpu-small"],
     "--preset cpu-small cannot be combined with --resume of a run started from preset 'tiny'"),
    ("resume-other-shape", [*R, "model.hidden=128"],
     "model.hidden: cannot change when resuming (the run was trained with 64, got 128)"),
    ("resume-other-experts", [*R, "model.moe.num_experts=8"],
     "model.moe.num_experts: cannot change when resuming (the run was trained with 4, got 8)"),
    ("resume-bad-value", [*R, "train.lr=0"], "train.lr: must be > 0 and finite, got 0.0"),
    ("eval-not-a-run", ["eval", "{root}/notrun"], "{root}/notrun/config.json not found"),
    ("eval-data-empty", ["eval", "{run}", "--data", ""], "--data: is empty ('')"),
]
if not torch.cuda.is_available():
    CASES.append(("no-cuda", [*T, "train.device=cuda"],
                  "train.device: 'cuda' requested but CUDA is not available on this machine"))


def _fill(items: list[str], env: dict, new: Path) -> list[str]:
    return [s.format(new=new, **env) for s in items]


def test_table_is_large_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(env, tmp_path, monkeypatch, capsys, argv, expected):
    monkeypatch.chdir(tmp_path)  # a stray default run directory (runs/...) would show up here
    new = tmp_path / "new-run"
    before = tree_digest(env["run"])
    capsys.readouterr()
    try:
        rc = main(_fill(argv, env, new))
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("moetrain")
    assert expected.format(new=new, **env) in lines[0]
    assert "Traceback" not in out + err
    assert tree_digest(env["run"]) == before  # not one byte of the existing run changed
    assert not new.exists() and list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback(env, tmp_path):
    argv = _fill([*T, "model.moe.top_k=8"], env, tmp_path / "new")
    with pytest.raises(MoetrainError, match="model.moe.top_k"):
        main(["--debug", *argv])
    with pytest.raises(MoetrainError, match="model.moe.top_k"):
        main([*argv, "--debug"])


def test_real_process_exit_status_and_stderr(env, tmp_path):
    """The same through a separate process: exit status 2 and one stderr line (argparse and a config error)."""
    for i, case in enumerate(("steps-not-int", "resume-other-shape")):
        argv, expected = next(c[1:] for c in CASES if c[0] == case)
        log = tmp_path / f"{i}.log"
        assert run_cli(_fill(argv, env, tmp_path / "new"), log) == 2
        text = log.read_text().strip().splitlines()
        assert text[-1].startswith("moetrain") and expected.format(new=tmp_path / "new", **env) in text[-1]
        assert "Traceback" not in log.read_text()


def test_binary_files_next_to_text_are_skipped_with_a_count(env, tmp_path, capsys):
    data = tmp_path / "mixed"
    shutil.copytree(env["root"] / "binary", data)
    (data / "text.txt").write_bytes(env["corpus"].read_bytes())
    assert main(["train", "--preset", "tiny", "--data", str(data), "--out", str(tmp_path / "run"),
                 "--no-progress", "--steps", "1", f"data.cache_dir={env['cache']}", "train.eval_batches=1"]) == 0
    assert "2 skipped (2 binary)" in capsys.readouterr().out
