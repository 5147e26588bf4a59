"""``train.optimizer_state``: only the newest checkpoint keeps the optimizer state ("newest", the default), or every
one ("all").

What is proved: the older kept checkpoints shrink by the AdamW moments' bytes (counted from the optimizer, not
from the files) and keep everything else; every checkpoint under a ``step_`` name verifies after a crash at each
step of the rewrite, and the next save finishes or undoes it; a corrupt older checkpoint is never rewritten (its
bad bytes never get a valid manifest); loading a checkpoint without moments warns once and continues like a fresh
AdamW from the same weights; eval-style loading is unaffected; a CLI ``--resume`` from one warns and finishes.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from conftest import sample_text
from moetrain.cli import main
from moetrain.config import build_config
from moetrain.model.transformer import MoETransformer
from moetrain.train import checkpoint as checkpoint_module
from moetrain.train.checkpoint import MANIFEST, MODEL_FILE, STATE_FILE, CheckpointStore
from moetrain.train.checkpointer import Checkpointer, load_latest_model
from moetrain.train.schedule import build_scheduler
from moetrain.train.state import TrainState
from moetrain.train.step import train_step
from moetrain.train.trainer import build_optimizer

BATCH, SEQ = 4, 8

pytestmark = pytest.mark.usefixtures("one_thread")


def _config():
    moe = {"num_experts": 4, "top_k": 2, "experts": {"ffn_hidden": 16}}
    return build_config("tiny", overrides={
        "model": {"vocab_size": 64, "hidden": 16, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "moe": moe,
                  "execution": {"moe_backend": "loop"}},
        "data": {"seq_len": SEQ}, "train": {"batch_size": BATCH, "lr": 1e-2, "warmup_steps": 3, "device": "cpu"},
    })


class _Sampler:
    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + self.position))
        self.position += 1
        return b[:, :-1], b[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _state(seed: int = 0) -> TrainState:
    cfg = _config()
    torch.manual_seed(seed)
    model = MoETransformer(cfg.model).double()
    opt = build_optimizer(model, cfg)
    return TrainState(model, opt, build_scheduler(opt, cfg.train), _Sampler(), config=cfg.to_dict())


def _train(state: TrainState, steps: int) -> list[float]:
    cfg = _config()
    losses = []
    for _ in range(steps):
        losses.append(float(train_step(state.model, state.sampler.next_batch, state.optimizer, state.scheduler,
                                       cfg.train, torch.device("cpu")).lm_loss))
        state.step += 1
    return losses


def _moment_tensors(state: TrainState) -> list[torch.Tensor]:
    """AdamW's tensors (exp_avg, exp_avg_sq, step per parameter)."""
    return [v for s in state.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def _save_steps(ckpt_dir: Path, steps: int, **kwargs) -> TrainState:
    """Train ``steps`` steps, saving after each."""
    state = _state()
    checkpointer = Checkpointer(ckpt_dir, **kwargs)
    for _ in range(steps):
        _train(state, 1)
        checkpointer.save(state, {"config.json": b"{}"})
    return state


def _all_verify(store: CheckpointStore) -> None:
    for name in store.names():
        assert store.verify(name) is None, (name, store.verify(name))


def _has_optimizer(store: CheckpointStore, name: str) -> bool:
    return "optimizer" in store.read_verified(name).train_state()


def test_newest_keeps_its_moments_and_older_ones_shrink_by_theirs(tmp_path):
    store = CheckpointStore(tmp_path)
    state = _state()
    checkpointer = Checkpointer(tmp_path, keep=3)
    for _ in range(2):
        _train(state, 1)
        checkpointer.save(state, {"config.json": b"{}"})
    before = store.read_verified("step_00000002")
    assert "optimizer" in before.train_state()
    tensors = _moment_tensors(state)
    moments = sum(t.numel() * t.element_size() for t in tensors)
    assert moments > 0
    _train(state, 1)
    checkpointer.save(state, {"config.json": b"{}"})

    assert store.names() == ["step_00000001", "step_00000002", "step_00000003"]
    _all_verify(store)
    assert [_has_optimizer(store, n) for n in store.names()] == [False, False, True]
    after = store.read_verified("step_00000002")
    shrunk = len(before.files[STATE_FILE]) - len(after.files[STATE_FILE])
    # the moments, each tensor's zip entry (~260 B, 64-B aligned) and the param groups: nothing else
    assert moments <= shrunk <= moments + 512 * len(tensors)
    for file in (MODEL_FILE, "config.json"):  # the other files are the same bytes (hard links)
        assert after.files[file] == before.files[file]
        assert (tmp_path / "step_00000002" / file).stat().st_nlink == 1  # the old directory's links are gone
    old, new = before.train_state(), after.train_state()
    assert set(old) - set(new) == {"optimizer"}
    for key in ("step", "scheduler", "sampler", "initial_val_loss", "config", "nonfinite_skips"):
        assert new[key] == old[key], key
    assert torch.equal(new["rng"]["torch"], old["rng"]["torch"]) and new["rng"]["python"] == old["rng"]["python"]
    meta = json.loads((tmp_path / "step_00000002" / MANIFEST).read_text())["meta"]
    assert meta == {"optimizer_state": False}
    assert "meta" not in json.loads((tmp_path / "step_00000003" / MANIFEST).read_text())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_without_hard_links_the_unchanged_files_are_copied(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(checkpoint_module.os, "link", refuse)
    _save_steps(tmp_path, 2, keep=2)
    store = CheckpointStore(tmp_path)
    _all_verify(store)
    assert [_has_optimizer(store, n) for n in store.names()] == [False, True]


def test_all_keeps_every_checkpoints_moments(tmp_path):
    _save_steps(tmp_path, 3, keep=2, optimizer_state="all")
    store = CheckpointStore(tmp_path)
    assert store.names() == ["step_00000002", "step_00000003"]
    _all_verify(store)
    assert all(_has_optimizer(store, n) for n in store.names())


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="optimizer_state: must be one of"):
        Checkpointer("/nonexistent", optimizer_state="some")


def test_a_corrupt_older_checkpoint_is_never_rewritten(tmp_path):
    state = _state()
    checkpointer = Checkpointer(tmp_path, keep=3, optimizer_state="all")
    for _ in range(2):
        _train(state, 1)
        checkpointer.save(state)
    victim = tmp_path / "step_00000001" / MODEL_FILE
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    manifest = (tmp_path / "step_00000001" / MANIFEST).read_bytes()
    checkpointer.optimizer_state = "newest"
    _train(state, 1)
    checkpointer.save(state)
    store = CheckpointStore(tmp_path)
    assert store.verify("step_00000001") is not None  # still reported as corrupt, not blessed by a new manifest
    assert (tmp_path / "step_00000001" / MANIFEST).read_bytes() == manifest
    assert [_has_optimizer(store, n) for n in store.names()[1:]] == [False, True]


class _Killed(Exception):
    """Stands for a kill: it skips every cleanup handler that catches OSError."""


def _kill_during_build(monkeypatch):
    real = checkpoint_module._write_synced

    def write(path, raw):
        if path.name == STATE_FILE and "-replace-" in path.parent.name:
            path.write_bytes(raw[: len(raw) // 2])  # half of the new train_state.pt on disk
            raise _Killed("building")
        real(path, raw)

    monkeypatch.setattr(checkpoint_module, "_write_synced", write)


def _kill_at(monkeypatch, stage: str):
    def hook(where: str) -> None:
        if where == stage:
            raise _Killed(where)

    monkeypatch.setattr(checkpoint_module, "_replace_stage", hook)


@pytest.mark.parametrize("stage", ["building", "built", "old_moved", "new_in"])
def test_a_crash_at_any_step_of_the_rewrite_leaves_only_verified_checkpoints(tmp_path, monkeypatch, stage):
    store = CheckpointStore(tmp_path)
    state = _save_steps(tmp_path, 2, keep=3)  # step 1 already without moments, step 2 with
    newest_before = {p.name: p.read_bytes() for p in (tmp_path / "step_00000002").iterdir()}
    with monkeypatch.context() as m:
        _kill_during_build(m) if stage == "building" else _kill_at(m, stage)
        _train(state, 1)
        with pytest.raises(_Killed):
            Checkpointer(tmp_path, keep=3).save(state)  # step 3 is committed, then step 2 is being rewritten
    _all_verify(store)
    newest = {p.name: p.read_bytes() for p in (tmp_path / "step_00000003").iterdir()}
    assert _has_optimizer(store, "step_00000003") and MODEL_FILE in newest
    expect = {"building": ["step_00000001", "step_00000002", "step_00000003"],
              "built": ["step_00000001", "step_00000002", "step_00000003"],
              "old_moved": ["step_00000001", "step_00000003"],  # at worst the older one is missing for now
              "new_in": ["step_00000001", "step_00000002", "step_00000003"]}[stage]
    assert store.names() == expect
    if "step_00000002" in expect:  # either the old version, whole, or the new one
        ckpt = store.read_verified("step_00000002")
        if stage in ("building", "built"):
            assert {f: ckpt.files[f] for f in newest_before if f != MANIFEST} == \
                   {f: b for f, b in newest_before.items() if f != MANIFEST}
        assert _has_optimizer(store, "step_00000002") == (stage != "new_in")
    # a resume would pick the untouched newest; the next save finishes the job (the new version renamed in)
    assert store.latest_valid()[0].name == "step_00000003"
    _train(state, 1)
    Checkpointer(tmp_path, keep=4).save(state)
    assert store.names() == ["step_00000001", "step_00000002", "step_00000003", "step_00000004"]
    _all_verify(store)
    assert [_has_optimizer(store, n) for n in store.names()] == [False, False, False, True]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_loading_a_checkpoint_without_moments_warns_and_continues_like_a_fresh_adamw(tmp_path):
    state = _save_steps(tmp_path, 2, keep=2)
    ckpt = CheckpointStore(tmp_path).read_verified("step_00000001")
    reference = _state()
    _train(reference, 1)  # the state that step 1 saved ...
    reference.optimizer.state = defaultdict(dict)  # ... with AdamW's moments dropped: what the resume must equal
    ref_losses = _train(reference, 3)

    fresh, lines = _state(seed=7), []
    Checkpointer(tmp_path).load(ckpt, fresh, warn=lines.append)
    assert lines == [f"warning: checkpoint {tmp_path / 'step_00000001'} holds no optimizer state "
                     "(train.optimizer_state=newest keeps it in the newest checkpoint only): weights loaded, AdamW "
                     "moments start afresh"]
    assert (fresh.step, fresh.sampler.position) == (1, 1) and len(fresh.optimizer.state) == 0
    assert _train(fresh, 3) == ref_losses
    assert state.step == 2


def test_eval_style_loading_is_unaffected(tmp_path):
    state = _save_steps(tmp_path, 2, keep=2)
    (tmp_path / "step_00000002").rename(tmp_path / "elsewhere")  # only the stripped checkpoint is left
    model, lines = MoETransformer(_config().model).double(), []
    ckpt = load_latest_model(tmp_path, model, warn=lines.append)
    assert ckpt.name == "step_00000001" and lines == []
    saved = CheckpointStore(tmp_path).read_verified("step_00000001").model_tensors()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)
    assert state.step == 2


# -- the CLI ------------------------------------------------------------------------------------------------------
def _args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--no-progress", "--steps", "6",
            f"data.cache_dir={out.parent / 'cache'}", "data.seq_len=32", "train.batch_size=4", "train.log_every=1",
            "train.ckpt_every=2", "train.eval_every=0", "train.eval_batches=1", "monitor.tb_heatmap=false",
            "monitor.tb_histograms=false", *extra]


def test_cli_resume_from_a_checkpoint_without_moments_warns_and_finishes(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(sample_text(50_000))
    run = tmp_path / "run"
    assert main([*_args(corpus, run), "--stop-at-step", "4"]) == 0
    store = CheckpointStore(run / "checkpoints")
    assert store.names() == ["step_00000002", "step_00000004"]
    _all_verify(store)
    assert [_has_optimizer(store, n) for n in store.names()] == [False, True]
    (run / "checkpoints" / "step_00000004").rename(run / "step_00000004-moved")  # the user deleted the newest
    capsys.readouterr()
    assert main([*_args(corpus, run), "--resume"]) == 0
    out = capsys.readouterr().out
    step2 = run / "checkpoints" / "step_00000002"
    assert f"warning: checkpoint {step2} holds no optimizer state" in out
    assert f"resumed from {step2} at step 2" in out
    assert store.names() == ["step_00000004", "step_00000006"]
    assert [_has_optimizer(store, n) for n in store.names()] == [False, True]
