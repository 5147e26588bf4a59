"""``moetrain train --init-from HF_DIR``: fine-tune a Hugging Face checkpoint with our trainer: the model config and
tokenizer from the checkpoint, the rest as usual (what ``model.*`` overrides may change, and why a preset's
regulariser for training from scratch is left out: docs/hf-interop.md, "Fine-tuning").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetrain.configlib import merge, to_dict
from moetrain.errors import ConfigError, DataError
from moetrain.interop.families import flat_fields, training_only
from moetrain.interop.hf import TOKENIZER_FILE, from_hf, read_hf_config
from moetrain.model.config import ModelConfig


# Train fields a preset may set for training from scratch that would harm a pretrained model (docs/hf-interop.md).
FROM_SCRATCH = {"expert_weight_decay": "a regulariser for training from scratch; the experts decay like the rest"}


@dataclass
class InitFrom:
    """An imported checkpoint ready to start a run.

    Attributes:
        model: the imported model config.
        weights: our tensor names -> fp32 tensors (tied duplicates dropped), for ``Trainer(init_weights=...)``.
        tokenizer: the checkpoint's ``tokenizer.json``.
    """

    model: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Path

    def config(self, preset: str | None, file_data: dict[str, Any] | None, overrides: dict[str, Any]):
        """The run's :class:`~moetrain.config.Config` and its notes: preset, then file, then this model, then
        overrides; of the preset's train fields, those in :data:`FROM_SCRATCH` are left out (each with a note), so a
        pretrained model is not regularised by a recipe for training from scratch unless the file or an override
        asks for it.

        Returns:
            (config, notes): one ``note: ...`` line per preset value left out.
        Raises:
            ConfigError: an override that changes the imported architecture (the field is named).
        """
        from moetrain.config import Config, choose_preset, upgrade
        from moetrain.presets import preset_dict

        base = preset_dict(choose_preset(preset, file_data, overrides))
        given = merge(upgrade(file_data or {}), upgrade(overrides)).get("train", {})
        notes = []
        for name, why in FROM_SCRATCH.items():
            if name in base.get("train", {}) and name not in given:
                value = base["train"].pop(name)
                notes.append(f"note: --init-from: train.{name} is left at its default, not the preset "
                             f"{base['preset']!r}'s {value} ({why}); set it to keep it")
        data = merge(base, upgrade(file_data or {}))
        data["model"] = to_dict(self.model)
        config = Config.from_dict(merge(data, upgrade(overrides)))
        _check_same_architecture(self.model, config.model)
        return config, notes


def _check_same_architecture(imported: ModelConfig, final: ModelConfig) -> None:
    before, after = flat_fields(imported), flat_fields(final)
    for path, value in after.items():
        if not training_only(path) and value != before[path]:
            raise ConfigError(f"model.{path}={value!r}: --init-from fixes the architecture to the checkpoint's "
                              f"({before[path]!r})")


def load_init(hf_dir: str | Path) -> InitFrom:
    """Import ``hf_dir`` (config, weights and tokenizer) for fine-tuning.

    Raises:
        MoetrainError: the errors of :func:`~moetrain.interop.hf.from_hf`, or no ``tokenizer.json`` in ``hf_dir``.
    """
    from moetrain.train.checkpoint import model_tensors

    root = Path(hf_dir)
    read_hf_config(root)  # a missing directory / config.json / unsupported model_type first
    tokenizer = root / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise DataError(f"--init-from {root}: no {TOKENIZER_FILE}; fine-tuning keeps the checkpoint's tokenizer "
                        "(a fast tokenizer saved by transformers' save_pretrained)")
    model = from_hf(root, dtype=torch.float32)
    return InitFrom(model=model.config, weights=model_tensors(model), tokenizer=tokenizer)
