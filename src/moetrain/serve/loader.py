"""Loading what ``moetrain serve`` serves: a moetrain run directory or a Hugging Face directory written by
``moetrain export`` / ``moetrain upcycle`` (any family :func:`moetrain.interop.hf.from_hf` reads)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrain.errors import MoetrainError


@dataclass(frozen=True)
class ServedModel:
    """A model ready to serve.

    Attributes:
        model: the :class:`~moetrain.model.transformer.MoETransformer`, fp32, eval mode.
        tokenizer: a ``tokenizers.Tokenizer``.
        eos_id: the end-of-text token id, or ``None`` when the tokenizer has none.
        name: what ``/v1/completions`` reports as ``model`` (the directory's name).
        fingerprint: sha256 hex of the weights' identity (path, checkpoint step or file sizes and mtimes); part
            of every response-cache key, so two servers of the same checkpoint share cache entries and a new
            checkpoint never reads an old entry.
        source: ``run`` or ``hf``.
        root: the served directory (resolved).
        checkpoint: a run's checkpoint directory (its location) and ``step``; ``None`` for a Hugging Face directory.
    """

    model: Any
    tokenizer: Any
    eos_id: int | None
    name: str
    fingerprint: str
    source: str
    root: str = ""
    checkpoint: str | None = None
    step: int | None = None

    def experts_file(self) -> str | None:
        """The local single-format checkpoint's ``model.safetensors`` (holding the [E, ...] expert weights this model
        loaded), or ``None`` (a Hugging Face directory, a sharded or remote checkpoint)."""
        if self.checkpoint is None:
            return None
        f = Path(self.checkpoint) / "model.safetensors"
        return str(f) if f.is_file() else None


def load_served_model(path: str) -> ServedModel:
    """Load ``path``: a run directory (``config.json`` with a ``model`` section, ``tokenizer.json`` and
    ``checkpoints/``) or a Hugging Face directory (``config.json`` with ``model_type``, safetensors weights and
    ``tokenizer.json``).

    Raises:
        MoetrainError: not a directory, neither kind, no tokenizer, or the loaders' own errors (a bad checkpoint,
            an unsupported model_type).
    """
    import torch
    from tokenizers import Tokenizer

    from moetrain.data.tokenizer import EOS_TOKEN

    root = Path(path)
    if not root.is_dir():
        raise MoetrainError(f"{root}: no such directory (expected a run directory or a Hugging Face directory)")
    config_file = root / "config.json"
    try:
        raw = json.loads(config_file.read_text()) if config_file.is_file() else None
    except (ValueError, UnicodeDecodeError) as e:
        raise MoetrainError(f"{config_file}: cannot parse: {e}") from None
    if isinstance(raw, dict) and "model_type" in raw:
        from moetrain.interop.hf import from_hf

        if not (root / "tokenizer.json").is_file():
            raise MoetrainError(f"{root}: no tokenizer.json (serve needs the fast tokenizer that `moetrain export` "
                                "and `moetrain upcycle` write)")
        model = from_hf(root, dtype=torch.float32).eval()
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        weights = sorted(p for p in root.iterdir() if p.name.endswith(".safetensors"))
        ident = [str(root.resolve())] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in weights]
        source, checkpoint, step = "hf", None, None
    else:
        from moetrain.commands.run_dir import load_run

        run = load_run(str(root))
        model, tokenizer = run.model.float().eval(), run.tokenizer
        ident = [str(root.resolve()), run.checkpoint.location, str(run.checkpoint.step)]
        source, checkpoint, step = "run", run.checkpoint.location, run.checkpoint.step
    for p in model.parameters():
        p.requires_grad_(False)
    fingerprint = hashlib.sha256("\n".join(ident).encode()).hexdigest()
    return ServedModel(model, tokenizer, tokenizer.token_to_id(EOS_TOKEN), root.resolve().name, fingerprint, source,
                       str(root.resolve()), checkpoint, step)
