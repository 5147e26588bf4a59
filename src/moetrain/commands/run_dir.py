"""Loading a finished (or in-progress) run directory: config, tokenizer and newest valid checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moetrain.errors import MoetrainError


def load_run(run_dir: str):
    """(config, tokenizer, model with the newest valid checkpoint's weights) of a run directory."""
    from tokenizers import Tokenizer

    from moetrain.config import Config
    from moetrain.model.transformer import MoETransformer
    from moetrain.train.checkpoint import latest_valid_checkpoint, load_model_weights
    from moetrain.train.trainer import CONFIG_FILE, TOKENIZER_FILE

    root = Path(run_dir)
    for name in (CONFIG_FILE, TOKENIZER_FILE):
        if not (root / name).is_file():
            raise MoetrainError(f"{root / name} not found; is '{root}' a moetrain run directory?")
    config = Config.from_dict(json.loads((root / CONFIG_FILE).read_text()))
    path = latest_valid_checkpoint(root / "checkpoints", warn=lambda m: print(m, file=sys.stderr))
    if path is None:
        raise MoetrainError(f"no usable checkpoint in {root / 'checkpoints'}")
    model = MoETransformer(config.model)
    load_model_weights(model, path)
    model.eval()
    return config, Tokenizer.from_file(str(root / TOKENIZER_FILE)), model
