"""Checkpoint store: manifest verification (every file, flipped byte or truncation), fallback to the previous
checkpoint, crash leftovers, keep-last-K + milestones, model tensors (buffers, tied weights, shape mismatch)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from moetrain.config import build_config
from moetrain.errors import CheckpointError
from moetrain.model.transformer import MoETransformer
from moetrain.train.checkpoint import (
    MANIFEST,
    MODEL_FILE,
    STATE_FILE,
    CheckpointStore,
    encode_model,
    encode_state,
    load_model_weights,
    model_tensors,
)

FILES = [MODEL_FILE, STATE_FILE, "tokenizer.json", "config.json", MANIFEST]


def _tiny_model(**moe) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(build_config("tiny", overrides={"model": {"moe": moe}} if moe else None).model)


def _files(step: int) -> dict[str, bytes]:
    """A realistic checkpoint's files (a tiny model, an optimizer-like state, tokenizer/config text)."""
    model = _tiny_model()
    with torch.no_grad():
        next(model.parameters()).add_(step)  # each step's weights differ
    state = {"step": step, "optimizer": {"state": {0: {"exp_avg": torch.full((3,), float(step))}}},
             "rng": {"python": random.Random(step).getstate()}}
    return {MODEL_FILE: encode_model(model), STATE_FILE: encode_state(state),
            "tokenizer.json": json.dumps({"model": "bpe", "step": step}).encode(),
            "config.json": json.dumps({"train": {"steps": 10}}).encode()}


@pytest.fixture(scope="module")
def three_files():
    return {s: _files(s) for s in (2, 4, 6)}


def _store_with(root: Path, files_by_step: dict[int, dict[str, bytes]]) -> CheckpointStore:
    store = CheckpointStore(root)
    for step, files in files_by_step.items():
        store.save(step, files)
    return store


def test_round_trip_and_manifest_content(tmp_path, three_files):
    store = _store_with(tmp_path / "ckpt", three_files)
    assert store.names() == ["step_00000002", "step_00000004", "step_00000006"]
    warnings = []
    ckpt, skipped = store.latest_valid(warn=warnings.append)
    assert (ckpt.step, skipped, warnings) == (6, [], [])
    assert ckpt.files == three_files[6]
    manifest = json.loads((tmp_path / "ckpt/step_00000006" / MANIFEST).read_text())
    import hashlib
    for name, raw in three_files[6].items():  # sizes and digests recomputed independently
        assert manifest["files"][name] == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    assert ckpt.train_state()["optimizer"]["state"][0]["exp_avg"].tolist() == [6.0] * 3
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))  # the temporary directory was renamed into place


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("victim", FILES)
def test_damaged_newest_falls_back_to_previous_with_warning_naming_the_file(tmp_path, three_files, victim, damage):
    store = _store_with(tmp_path / "ckpt", three_files)
    path = tmp_path / "ckpt/step_00000006" / victim
    raw = bytearray(path.read_bytes())
    rng = random.Random(f"{victim}-{damage}")
    if damage == "flip":
        i = rng.randrange(len(raw))
        raw[i] ^= 1 << rng.randrange(8)
    else:
        del raw[rng.randrange(len(raw)):]
    path.write_bytes(bytes(raw))
    warnings = []
    ckpt, skipped = store.latest_valid(warn=warnings.append)
    assert ckpt.step == 4 and ckpt.files == three_files[4]
    assert skipped == ["step_00000006"]
    assert len(warnings) == 1 and str(path) in warnings[0] and warnings[0].startswith("warning: skipping checkpoint")


def test_every_single_bit_flip_of_the_manifest_is_detected(tmp_path, three_files):
    """The manifest digests itself, so no edit of it (a step number, a size, a file name) goes unnoticed."""
    store = _store_with(tmp_path / "ckpt", {6: {MODEL_FILE: b"weights", STATE_FILE: b"state"}})
    path = tmp_path / "ckpt/step_00000006" / MANIFEST
    good = path.read_bytes()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x01
        path.write_bytes(bytes(bad))
        assert store.verify("step_00000006") is not None, f"flip at byte {i} went unnoticed"
    path.write_bytes(good)
    assert store.verify("step_00000006") is None


def test_all_damaged_returns_none_and_names_each(tmp_path, three_files):
    store = _store_with(tmp_path / "ckpt", three_files)
    for step in three_files:
        (tmp_path / f"ckpt/step_{step:08d}" / STATE_FILE).write_bytes(b"")
    warnings = []
    ckpt, skipped = store.latest_valid(warn=warnings.append)
    assert ckpt is None and len(skipped) == 3 and len(warnings) == 3


def test_crash_leftovers_are_never_loaded_and_are_cleaned_up(tmp_path, three_files):
    store = _store_with(tmp_path / "ckpt", {2: three_files[2]})
    # A save killed half-way: a temporary directory with some files and no manifest.
    tmp = tmp_path / "ckpt/.tmp-step_00000004-12345"
    tmp.mkdir()
    (tmp / MODEL_FILE).write_bytes(three_files[4][MODEL_FILE][:100])
    # An object-store style partial checkpoint: named like a complete one but without its manifest.
    partial = tmp_path / "ckpt/step_00000006"
    partial.mkdir()
    (partial / MODEL_FILE).write_bytes(three_files[6][MODEL_FILE])
    warnings = []
    ckpt, skipped = store.latest_valid(warn=warnings.append)
    assert ckpt.step == 2 and skipped == ["step_00000006"]
    assert "manifest.json: missing" in warnings[0]
    store.save(4, three_files[4])
    assert not tmp.exists()


def test_resaving_a_step_replaces_it(tmp_path, three_files):
    store = _store_with(tmp_path / "ckpt", {4: three_files[2]})
    store.save(4, three_files[4])
    ckpt, _ = store.latest_valid()
    assert ckpt.files == three_files[4] and store.names() == ["step_00000004"]


def test_prune_keeps_last_k_and_milestones(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    for step in range(1, 11):
        store.save(step, {"x": str(step).encode()})
        store.prune(keep=2, milestone_every=4)
    assert store.names() == ["step_00000004", "step_00000008", "step_00000009", "step_00000010"]
    store.prune(keep=1)
    assert store.names() == ["step_00000010"]


def test_quarantine_moves_aside(tmp_path, three_files):
    store = _store_with(tmp_path / "ckpt", three_files)
    new = store.quarantine("step_00000006")
    assert Path(new).is_dir() and Path(new).name.startswith("corrupt-step_00000006")
    assert store.names() == ["step_00000002", "step_00000004"]


def test_model_tensors_round_trip_buffers_and_tied_weights():
    src = _tiny_model(router={"expert_bias": True})
    buffers = {n: b for n, b in src.named_buffers() if "bias" in n}
    assert buffers, "the router's expert bias should be a buffer"
    with torch.no_grad():
        for b in buffers.values():
            b.copy_(torch.randn_like(b))
    blob = encode_model(src)
    dst = _tiny_model(router={"expert_bias": True})
    torch.manual_seed(123)
    for p in dst.parameters():
        torch.nn.init.normal_(p)
    from safetensors.torch import load
    load_model_weights(dst, load(blob), "test")
    a, b = src.state_dict(), dst.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # Tied weights are stored once and still shared after loading.
    stored = load(blob)
    assert len(stored) == len(model_tensors(src)) <= len(a)
    if src.config.tie_embeddings:
        shared = [n for n in a if n not in stored]
        assert shared, "tied embeddings should be stored once"


def test_shape_mismatch_names_the_first_tensor():
    from safetensors.torch import load

    small = MoETransformer(build_config("tiny", overrides={"model": {"hidden": 32}}).model)
    big = _tiny_model()
    with pytest.raises(CheckpointError) as e:
        load_model_weights(big, load(encode_model(small)), "run/checkpoints/step_00000002/model.safetensors")
    first = next(iter(model_tensors(big)))
    msg = str(e.value)
    assert f"tensor '{first}' has shape" in msg and "the model expects" in msg and "\n" not in msg
    assert msg.startswith("run/checkpoints/step_00000002/model.safetensors")


def test_write_delay_hook_sleeps_after_each_file(tmp_path, monkeypatch, three_files):
    """The fault-injection hook used by the kill tests: one sleep per file written, content unchanged."""
    from moetrain.train import checkpoint

    sleeps = []
    monkeypatch.setattr(checkpoint.time, "sleep", sleeps.append)
    monkeypatch.setenv("MOETRAIN_CKPT_WRITE_DELAY", "0.05")
    store = _store_with(tmp_path / "ckpt", {2: three_files[2]})
    assert sleeps == [0.05] * (len(three_files[2]) + 1)  # the files, then the manifest
    assert store.latest_valid()[0].files == three_files[2]


def test_unknown_protocol_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="nosuchproto://x"):
        CheckpointStore("nosuchproto://x")

