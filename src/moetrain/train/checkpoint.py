"""Atomic, verified checkpoints.

Layout: ``RUN_DIR/checkpoints/step_00000100/`` with ``model.safetensors`` (weights), ``train_state.pt`` (optimizer,
scheduler, step, RNG states, data position) and ``manifest.json`` (size and SHA-256 of each file). A checkpoint
is written into a hidden temporary directory, every file fsynced, then renamed into place, so a crash at any
moment leaves either the complete checkpoint or none. Loading verifies the manifest and falls back to the newest
checkpoint that verifies, warning about each one it skips.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from moetrain.errors import CheckpointError

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step_(\d{8})$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with tied (shared-storage) duplicates dropped and tensors made contiguous on CPU."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict().items():
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return out


def save_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint ``step`` atomically under ``ckpt_root``; then delete all but the newest ``keep``.

    Args:
        ckpt_root: ``RUN_DIR/checkpoints``.
        step: optimizer steps completed.
        model: weights saved to safetensors.
        state: everything else (picklable by ``torch.save``).
        keep: how many checkpoints to keep (>= 1).
    Returns:
        The checkpoint directory.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-step_{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(model_tensors(model), str(tmp / MODEL_FILE))
    torch.save(state, tmp / STATE_FILE)
    manifest = {"step": step, "files": {}}
    for name in (MODEL_FILE, STATE_FILE):
        _fsync(tmp / name)
        manifest["files"][name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    if final.exists():  # re-saving the same step (e.g. an end-of-run save after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(ckpt_root)
    for old in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete (renamed-into-place) checkpoint directories, oldest first."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and _NAME.match(p.name))


def verify_checkpoint(path: Path) -> str | None:
    """``None`` if the checkpoint's files match its manifest, else the reason (naming the file)."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{manifest_path}: unreadable manifest ({e.__class__.__name__})"
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != info["bytes"]:
            return f"{f}: {size} bytes, manifest says {info['bytes']} (truncated?)"
        if _sha256(f) != info["sha256"]:
            return f"{f}: SHA-256 does not match the manifest (corrupt)"
    return None


def latest_valid_checkpoint(ckpt_root: Path, warn: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint that verifies; each newer one that fails is reported through ``warn``."""
    for path in reversed(list_checkpoints(ckpt_root)):
        reason = verify_checkpoint(path)
        if reason is None:
            return path
        warn(f"warning: skipping checkpoint {path}: {reason}")
    return None


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Load ``path/model.safetensors`` into ``model``.

    Raises:
        CheckpointError: a missing or extra tensor, or a shape mismatch (the first mismatching tensor is named with
            both shapes).
    """
    tensors = load_file(str(path / MODEL_FILE))
    expected = model_tensors(model)
    for name, t in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path / MODEL_FILE}: tensor '{name}' is missing (a different model?)")
        if tensors[name].shape != t.shape:
            raise CheckpointError(
                f"{path / MODEL_FILE}: tensor '{name}' has shape {tuple(tensors[name].shape)}, "
                f"the model expects {tuple(t.shape)} (checkpoint from a different model shape)"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{path / MODEL_FILE}: unexpected tensor '{extra[0]}' (a different model?)")
    model.load_state_dict(tensors, strict=False)


def load_train_state(path: Path) -> dict[str, Any]:
    """The non-weight state saved by :func:`save_checkpoint` (trusted: written by this program)."""
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
