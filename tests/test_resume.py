"""Exact resume (in-process CLI runs, tiny preset, CPU, deterministic) and non-finite step skipping.

The reference is always an uninterrupted run with the same config; ``metrics.jsonl`` is compared step by step
(``train.log_every=1``) with exact float equality, and weights bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from _crash_util import losses_by_step, metrics, val_by_step
from conftest import sample_text
from moetrain.cli import main
from moetrain.errors import MoetrainError
from moetrain.train.checkpoint import MODEL_FILE, STATE_FILE, CheckpointStore

STEPS = 40


pytestmark = pytest.mark.usefixtures("one_thread")


def _args(corpus: Path, cache: Path, out: Path, *extra: str, preset: bool = True) -> list[str]:
    return ["train", *(["--preset", "tiny"] if preset else []), "--data", str(corpus), "--out", str(out),
            "--no-progress", "--steps", str(STEPS), f"data.cache_dir={cache}", "data.seq_len=32",
            "train.batch_size=4", "train.log_every=1", "train.ckpt_every=5", "train.eval_every=10",
            "train.eval_batches=1", "monitor.tb_heatmap=false", "monitor.tb_histograms=false", *extra]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    corpus = root / "corpus.txt"
    corpus.write_bytes(sample_text(100_000))
    assert main(_args(corpus, root / "cache", root / "ref")) == 0
    return root, corpus


def _weights(run: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    store = CheckpointStore(run / "checkpoints")
    if step is None:
        return store.latest_valid()[0].model_tensors()
    return store.read_verified(f"step_{step:08d}").model_tensors()


def _assert_same(run: Path, reference: Path) -> None:
    want = losses_by_step(reference)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert losses_by_step(run) == want
    assert val_by_step(run) == val_by_step(reference)
    a, b = _weights(run), _weights(reference)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_after_20_steps_equals_uninterrupted_40_step_run(ref, tmp_path, capsys):
    root, corpus = ref
    run = tmp_path / "run"
    assert main([*_args(corpus, root / "cache", run), "--stop-at-step", "20"]) == 0
    assert max(losses_by_step(run)) == 20
    assert main(_args(corpus, root / "cache", run, preset=False) + ["--resume"]) == 0
    assert f"resumed from {run / 'checkpoints' / 'step_00000020'} at step 20" in capsys.readouterr().out
    _assert_same(run, root / "ref")


def test_damaged_newest_checkpoint_and_tokenizer_fall_back_and_still_resume_exactly(ref, tmp_path, capsys):
    root, corpus = ref
    run = tmp_path / "run"
    # train.optimizer_state=all: the fallback checkpoint keeps its AdamW moments, so the resume is exact (with the
    # default, tests/test_optimizer_state.py: it warns and restarts the moments)
    assert main([*_args(corpus, root / "cache", run, "train.optimizer_state=all"), "--stop-at-step", "22"]) == 0
    newest = run / "checkpoints" / "step_00000022" / MODEL_FILE
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one flipped bit in the middle of the weights
    newest.write_bytes(bytes(raw))
    tok = run / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:100])  # a damaged run-directory tokenizer: the checkpoint's copy wins
    capsys.readouterr()
    assert main(_args(corpus, root / "cache", run, preset=False) + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {run / 'checkpoints' / 'step_00000022'}: {newest}: SHA-256" in out
    assert f"resumed from {run / 'checkpoints' / 'step_00000020'} at step 20" in out
    assert "moved the corrupt checkpoint" in out and list((run / "checkpoints").glob("corrupt-step_00000022-*"))
    assert "tokenizer.json is missing or differs from the checkpoint's copy" in out
    _assert_same(run, root / "ref")
    assert tok.read_bytes() == (root / "ref" / "tokenizer.json").read_bytes()


def _poison(monkeypatch, bad_steps: set[int]):
    """Make the LM loss of the given optimizer steps (1-based) NaN, as a diverging batch would."""
    from moetrain.train import step as step_module

    real = step_module.accumulate_gradients
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        acc = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] in bad_steps:
            acc.lm_loss = acc.lm_loss * float("nan")
        return acc

    monkeypatch.setattr(step_module, "accumulate_gradients", poisoned)


def test_a_nonfinite_step_is_skipped_without_touching_weights_or_optimizer(ref, tmp_path, monkeypatch, capsys):
    root, corpus = ref
    run = tmp_path / "run"
    _poison(monkeypatch, {7})
    assert main([*_args(corpus, root / "cache", run, "train.ckpt_every=1", "train.keep_checkpoints=100",
                        "train.optimizer_state=all"), "--stop-at-step", "9"]) == 0
    out = capsys.readouterr().out
    assert "warning: step 7: non-finite loss (nan)" in out and "update skipped (1 in a row, 1 in total" in out
    assert "trained 9 steps in " in out  # a run that ends normally closes with its summary
    skip = [r for r in metrics(run) if r.get("skipped_nonfinite")]
    assert skip == [{"step": 7, "skipped_nonfinite": True, "nonfinite_skips": 1}]
    store = CheckpointStore(run / "checkpoints")
    before, after = store.read_verified("step_00000006"), store.read_verified("step_00000007")
    a, b = before.model_tensors(), after.model_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a)  # no parameter or buffer changed
    sa, sb = before.train_state(), after.train_state()
    assert sa["scheduler"] == sb["scheduler"]  # the LR schedule did not advance
    for pid, st in sa["optimizer"]["state"].items():  # AdamW's moments and step counts are untouched
        for key, value in st.items():
            assert torch.equal(value, sb["optimizer"]["state"][pid][key]), (pid, key)
    assert sb["nonfinite_skips"] == (1, 1)
    assert not torch.equal(_weights(run, 8)[next(iter(a))], a[next(iter(a))])  # training went on afterwards


def test_consecutive_nonfinite_steps_stop_with_error_and_a_checkpoint_of_the_last_good_state(
        ref, tmp_path, monkeypatch, capsys):
    root, corpus = ref
    run = tmp_path / "run"
    _poison(monkeypatch, set(range(6, 100)))
    rc = main(_args(corpus, root / "cache", run, "train.ckpt_every=5", "train.max_nonfinite_skips=3"))
    assert rc == 2
    captured = capsys.readouterr()
    assert "trained " not in captured.out  # no summary line that reads like success above the error
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moetrain: error: train.max_nonfinite_skips: 3 consecutive steps "
                                               "(6-8) had a non-finite loss or gradient")
    assert str(run / "checkpoints" / "step_00000008") in err[0]
    store = CheckpointStore(run / "checkpoints")
    assert store.names()[-1] == "step_00000008"
    good, final = store.read_verified("step_00000005"), store.read_verified("step_00000008")
    a, b = good.model_tensors(), final.model_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the weights of the last good step (5)
    assert final.train_state()["nonfinite_skips"] == (3, 3)


def test_train_step_skip_leaves_parameters_optimizer_and_schedule_alone():
    """Unit level: a non-finite gradient (not the loss) is caught through the gradient norm."""
    from moetrain.config import build_config
    from moetrain.model.transformer import MoETransformer
    from moetrain.train.schedule import build_scheduler
    from moetrain.train.step import train_step
    from moetrain.train.trainer import build_optimizer

    cfg = build_config("tiny")
    torch.manual_seed(0)
    model = MoETransformer(cfg.model)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg.train)
    gen = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=gen)
        return x, torch.roll(x, -1, 1)

    assert not train_step(model, batch, opt, sched, cfg.train, torch.device("cpu")).skipped
    params = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    lr_epoch = sched.last_epoch
    p0 = next(model.parameters())
    handle = p0.register_hook(lambda g: g * float("inf"))
    result = train_step(model, batch, opt, sched, cfg.train, torch.device("cpu"))
    handle.remove()
    assert result.skipped and not torch.isfinite(result.grad_norm) and torch.isfinite(result.lm_loss)
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(opt_state[id(p)][k], v) for p, s in opt.state.items() for k, v in s.items())
    assert sched.last_epoch == lr_epoch and all(p.grad is None for p in model.parameters())
    assert not train_step(model, batch, opt, sched, cfg.train, torch.device("cpu")).skipped


def test_resume_without_any_checkpoint_yet_starts_from_step_zero(ref, tmp_path, capsys):
    """A run killed before its first checkpoint: --resume starts over (same result), and says so."""
    root, corpus = ref
    run = tmp_path / "run"
    assert main([*_args(corpus, root / "cache", run), "--stop-at-step", "3"]) == 0
    shutil.rmtree(run / "checkpoints")
    capsys.readouterr()
    assert main(_args(corpus, root / "cache", run, preset=False) + ["--resume", "--stop-at-step", "3"]) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert losses_by_step(run) == {s: v for s, v in losses_by_step(root / "ref").items() if s <= 3}


def test_all_checkpoints_corrupt_is_an_error_not_a_fresh_start(ref, tmp_path, capsys):
    root, corpus = ref
    run = tmp_path / "run"
    assert main([*_args(corpus, root / "cache", run), "--stop-at-step", "5"]) == 0
    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / STATE_FILE).write_bytes(b"")
    capsys.readouterr()
    assert main(_args(corpus, root / "cache", run, preset=False) + ["--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moetrain: error: --resume: no checkpoint in") and "verifies" in err
    with pytest.raises(MoetrainError):
        main(["--debug", *_args(corpus, root / "cache", run, preset=False), "--resume"])
