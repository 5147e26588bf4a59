"""Loading a finished (or in-progress) run directory: config, tokenizer and newest valid checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from moetrain.errors import MoetrainError


class CheckpointInfo(NamedTuple):
    """Which checkpoint a loaded run's weights came from: its location, step, and the ``config.json`` saved in it
    (as a dict; ``None`` if absent or unreadable), which is the config that training had at that step."""

    location: str
    step: int
    config: dict | None


class Run(NamedTuple):
    """A run directory, loaded: its config, tokenizer, and model with the newest valid checkpoint's weights (in eval
    mode), and which checkpoint that was."""

    config: Any
    tokenizer: Any
    model: Any
    checkpoint: CheckpointInfo


def refuse_hugging_face_dir(root: Path, config: Any) -> None:
    """Raise if ``config`` (the parsed ``config.json`` of ``root``) is transformers', not a run's: a directory written
    by ``moetrain export`` / ``upcycle`` is served, not read as a run.

    Raises:
        MoetrainError: naming the directory and its ``model_type``.
    """
    if isinstance(config, dict) and "model_type" in config and "model" not in config:
        raise MoetrainError(f"{root}: a Hugging Face directory (model_type {config['model_type']!r}), not a moetrain "
                            f"run directory; serve it with `moetrain serve {root}`")


def read_run_config(run_dir: str | Path) -> dict:
    """The parsed ``config.json`` of the run directory ``run_dir`` (plain data, old field paths not yet moved).

    Raises:
        MoetrainError: no ``config.json``, an unparsable one or not a JSON object, or a Hugging Face directory's.
    """
    root = Path(run_dir)
    path = root / "config.json"
    if not path.is_file():
        raise MoetrainError(f"{path} not found; is '{root}' a moetrain run directory?")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise MoetrainError(f"{path}: cannot parse: {e}") from None
    refuse_hugging_face_dir(root, raw)
    if not isinstance(raw, dict):
        raise MoetrainError(f"{path}: not a JSON object of config fields")
    return raw


def load_run(run_dir: str) -> Run:
    """Load a run directory (:class:`Run`).

    Raises:
        MoetrainError: not a run directory (a Hugging Face directory included), or an unparsable config.
        DataError: an unreadable or damaged tokenizer.json (checked before the model is built).
        CheckpointError: no usable checkpoint.
    """
    from moetrain.config import Config
    from moetrain.data.tokenizer import load_tokenizer
    from moetrain.model.transformer import MoETransformer
    from moetrain.train.checkpointer import load_latest_model
    from moetrain.train.trainer import CONFIG_FILE, TOKENIZER_FILE

    root = Path(run_dir)
    config = Config.from_dict(read_run_config(root))
    if not (root / TOKENIZER_FILE).is_file():
        raise MoetrainError(f"{root / TOKENIZER_FILE} not found; is '{root}' a moetrain run directory?")
    tokenizer = load_tokenizer(root / TOKENIZER_FILE)
    model = MoETransformer(config.model)
    ckpt = load_latest_model(config.train.checkpoint_url or root / "checkpoints", model,
                                   warn=lambda m: print(m, file=sys.stderr))
    model.eval()
    try:
        saved_config = json.loads(ckpt.files[CONFIG_FILE])
    except (KeyError, ValueError):
        saved_config = None
    info = CheckpointInfo(str(ckpt.location), ckpt.step, saved_config if isinstance(saved_config, dict) else None)
    return Run(config, tokenizer, model, info)
