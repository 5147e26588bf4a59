"""End to end: `moetrain train` on local corpora, then `generate` and `eval`; issue-2 bad inputs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.cli import main

from conftest import SHAKESPEARE


def _train(tmp_path: Path, data: Path, *extra: str) -> Path:
    out = tmp_path / "run"
    rc = main(["train", "--preset", "tiny", "--data", str(data), "--out", str(out), "--no-progress",
               f"data.cache_dir={tmp_path / 'cache'}", *extra])
    assert rc == 0
    return out


def test_tiny_run_on_code_corpus(tmp_path, code_corpus, capsys, monkeypatch):
    run = _train(tmp_path, code_corpus, "train.steps=20", "train.eval_every=10", "train.ckpt_every=10")
    for name in ("config.json", "tokenizer.json", "metrics.jsonl"):
        assert (run / name).is_file()
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000010", "step_00000020"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r]
    assert {"step", "train_loss", "lr", "tokens_per_s"} <= set(train[0])
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert vals[0] == records[0]["val_loss"] and records[0]["step"] == 0
    assert vals[-1] < 0.8 * vals[0]  # this corpus is very regular: 20 steps must cut the loss a lot

    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "20"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > len("def ")
    assert main(["eval", str(run), "--batches", "3"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "checkpoint step 20" in out and "training logged" not in out  # other batches
    # By default eval repeats training's last evaluation (same weights, batches and dtype): the same number.
    assert main(["eval", str(run)]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert f"val_loss {vals[-1]:.4f} " in first and "2 batches of 8 x 64 tokens, fp32, checkpoint step 20" in first
    assert second == f"training logged val_loss {vals[-1]:.4f} at step 20 on the same batches"
    # A crash can leave a torn last line that is not even UTF-8: eval still reports, and reads the good records.
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 20, "val_lo\xff\xfe')
    assert main(["eval", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == second
    # A diverged model: exp(800) overflows a float, the perplexity is infinite (not an OverflowError).
    from moetrain.train import trainer

    monkeypatch.setattr(trainer, "evaluate", lambda *args: 800.0)
    assert main(["eval", str(run), "--batches", "1"]) == 0
    assert capsys.readouterr().out.startswith("val_loss 800.0000  perplexity inf  (")


def test_eval_names_what_training_logged_only_if_it_evaluated_alike(tmp_path, code_corpus, capsys):
    """Checkpoints in an fsspec store (memory://, like s3://); then a resume that changes train.eval_batches but runs
    no step: RUN_DIR/config.json now says 1 batch, while step 10's record and checkpoint were made with 2."""
    url = f"memory://{tmp_path.name}/checkpoints"
    run = _train(tmp_path, code_corpus, "train.steps=10", "train.eval_every=10", f"train.checkpoint_url={url}")
    logged = [r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["step"] == 10 and "val_loss" in r]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert f"val_loss {logged[-1]:.4f} " in first and "2 batches of 8 x 64 tokens, fp32, checkpoint step 10" in first
    assert second == f"training logged val_loss {logged[-1]:.4f} at step 10 on the same batches"

    assert main(["train", "--out", str(run), "--resume", "--steps", "10", "--no-progress", "train.eval_batches=1"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    assert "1 batches of 8 x 64 tokens, fp32, checkpoint step 10" in out and "training logged" not in out


def test_eval_of_a_document_packed_run_uses_its_document_packed_validation_batches(tmp_path, capsys):
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog def return class import".split()
    corpus = tmp_path / "docs"  # documents of 30 to 800 words: packed rows differ from windows
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(30, 800))))
    run = _train(tmp_path, corpus, "train.steps=10", "train.eval_every=10", "data.packing=documents",
                 "data.val_fraction=0.3")
    logged = [r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["step"] == 10 and "val_loss" in r]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith(f"val_loss {logged[-1]:.4f} ") and "2 batches of 8 x 64 tokens" in first
    assert second == f"training logged val_loss {logged[-1]:.4f} at step 10 on the same batches"


def test_eval_does_not_call_an_edited_corpus_the_same_batches(tmp_path, code_corpus, capsys):
    run = _train(tmp_path, code_corpus, "train.steps=2", "train.eval_every=2", "data.val_fraction=0.5")
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    assert "on the same batches" in capsys.readouterr().out
    for f in code_corpus.iterdir():  # the corpus edited after training: other validation tokens
        f.write_text(f.read_text().replace("value", "other"))
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    assert "on the same batches" not in out and "validation batches differ from those training evaluated" in out


def test_a_resume_on_an_edited_corpus_says_its_validation_batches_changed(tmp_path, code_corpus, capsys):
    """Resuming after the corpus changed went on silently on other windows and another validation set, and the
    closing "(before training: ...)" compared different sets: the trainer now says so (val_sha256 of step 0)."""
    run = _train(tmp_path, code_corpus, "train.steps=2", "train.ckpt_every=2", "data.val_fraction=0.5")
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--steps", "3"]) == 0
    assert "validation batches differ" not in capsys.readouterr().out  # the same corpus: nothing to say
    for f in code_corpus.iterdir():
        f.write_text(f.read_text().replace("value", "other"))
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "warning: the validation batches differ from those this run evaluated before the resume" in out, out


def test_logged_val_loss_is_the_last_number_at_the_step(tmp_path):
    from moetrain.commands.eval import logged_val_loss

    assert logged_val_loss(tmp_path, 20) is None  # no metrics.jsonl
    lines = [b'{"step": 10, "val_loss": 3.0}', b'{"step": 20, "train_loss": 2.9}', b'{"step": 20, "val_loss": 2.5}',
             b'{"step": 20, "val_loss": 2.25}',  # logged again after a resume: the later one counts
             b'{"step": 30, "val_loss": null}',  # non-finite, as MetricsLogger writes it
             b'{"step": 40, "val_loss": 1.0}', b'{"step": 40, "val_loss": "oops"}', b'[40]', b'{"step": 40, "val\xff']
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines))
    expected = {10: 3.0, 20: 2.25, 30: None, 40: None, 50: None}
    assert {step: logged_val_loss(tmp_path, step) for step in expected} == expected


def test_tiny_run_on_tinyshakespeare(tmp_path):
    run = _train(tmp_path, SHAKESPEARE)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert vals[-1] < vals[0]


def _error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_issue2_bad_inputs(tmp_path, capsys, code_corpus):
    base = ["train", "--preset", "tiny", "--no-progress", f"data.cache_dir={tmp_path / 'cache'}"]
    assert "does not exist" in _error(capsys, [*base, "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "a")])
    (tmp_path / "empty").mkdir()
    assert "no usable text" in _error(capsys, [*base, "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "b")]) \
        or "no files" in _error(capsys, [*base, "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "b2")])
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n" * 5)
    assert "shorter than one sequence" in _error(capsys, [*base, "--data", str(short), "--out", str(tmp_path / "c")])
    msg = _error(capsys, [*base, "--data", str(code_corpus), "model.moe.top_k=9"])
    assert "model.moe.top_k" in msg and "9" in msg
    msg = _error(capsys, [*base, "--data", str(code_corpus), "model.hidden=30"])
    assert "model.hidden" in msg and "divisible" in msg


def test_entry_point_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moetrain", "train", "--preset", "nope"], capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["moetrain: error: --preset nope: unknown preset; choose one of "
                                                "['cpu-small', 'mixtral-8x7b', 'olmoe-1b-7b', 'qwen3-30b-a3b', 'tiny']"]


def test_overwrite_only_replaces_a_run_and_checks_data_first(tmp_path, capsys, code_corpus):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("important")
    base = ["train", "--preset", "tiny", "--no-progress", "--data", str(code_corpus), f"data.cache_dir={tmp_path / 'c'}"]
    msg = _error(capsys, [*base, "--out", str(precious), "--overwrite"])
    assert "not a moetrain run directory" in msg and (precious / "thesis.tex").read_text() == "important"
    run = _train(tmp_path, code_corpus, "train.steps=2", "train.eval_every=0")
    before = sorted(p.name for p in run.rglob("*"))
    msg = _error(capsys, ["train", "--preset", "tiny", "--out", str(run), "--overwrite", "--data",
                          str(tmp_path / "typo.txt")])
    assert "does not exist" in msg and sorted(p.name for p in run.rglob("*")) == before
    # Data that exists but is unusable (only binary; shorter than one sequence) is found before deleting too.
    (tmp_path / "archive.bin.part").write_bytes(b"\x1f\x8b\x08\0\0\0\0\0")  # a .gz is read as gzip
    (tmp_path / "short.txt").write_text("a few words\n")
    for bad, what in (("archive.bin.part", "no usable text"), ("short.txt", "shorter than one sequence")):
        msg = _error(capsys, ["train", "--preset", "tiny", "--out", str(run), "--overwrite", "--data",
                              str(tmp_path / bad), f"data.cache_dir={tmp_path / 'c'}"])
        assert what in msg and sorted(p.name for p in run.rglob("*")) == before
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "not a directory" in _error(capsys, [*base, "--out", str(a_file)])
    assert "not a directory" in _error(capsys, [*base, "--out", str(a_file / "sub")])


def test_more_bad_inputs_are_one_line(tmp_path, capsys, code_corpus):
    base = ["train", "--preset", "tiny", "--no-progress", "--data", str(code_corpus), "--out", str(tmp_path / "r")]
    assert "train.seed" in _error(capsys, [*base, "train.seed=-1"])
    cfg = tmp_path / "c.json"
    cfg.write_text("[1, 2]")
    assert "JSON object" in _error(capsys, [*base, "--config", str(cfg)])
    # `--data "$CORPUS"` with the variable unset: an error, not a run on the current directory.
    for empty in (["--data", ""], ["data.path= "]):
        msg = _error(capsys, ["train", "--preset", "tiny", "--no-progress", "--out", str(tmp_path / "r"), *empty])
        assert "data.path" in msg and "empty" in msg


def test_generate_defaults_fit_the_context_and_bad_sampling_values(tmp_path, capsys, code_corpus):
    run = _train(tmp_path, code_corpus, "train.steps=2", "train.eval_every=0")
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "def "]) == 0  # tiny's context is 128 < the default 200
    assert capsys.readouterr().out.startswith("def ")
    assert "--temperature" in _error(capsys, ["generate", str(run), "--prompt", "x", "--temperature", "nan"])
    assert "--max-new-tokens" in _error(capsys, ["generate", str(run), "--prompt", "x", "--max-new-tokens", "-1"])
    assert "--batches" in _error(capsys, ["eval", str(run), "--batches", "0"])


def test_final_val_line_names_the_step_it_was_computed_at(tmp_path, code_corpus, capsys):
    capsys.readouterr()
    _train(tmp_path, code_corpus, "train.steps=7", "train.eval_every=5", "--stop-at-step", "6")
    out = capsys.readouterr().out
    assert "step 5: val_loss" in out and "step 6: val_loss" not in out
