"""The analysis scripts of docs/moe-vs-dense.md (``benchmarks/val_by_file.py``, ``benchmarks/in_context_copy.py``):
their losses against independent computations."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from moetrain.config import build_config
from moetrain.model.transformer import MoETransformer

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(vocab: int = 512) -> MoETransformer:
    torch.manual_seed(0)
    cfg = build_config("tiny", overrides={"model": {"vocab_size": vocab}})
    return MoETransformer(cfg.model).eval()


def test_per_token_losses_average_to_the_model_s_own_lm_loss():
    """``token_losses`` (log-softmax of the fp32 logits, gathered) and ``doc_loss`` (the model's fused LM loss)
    score the same windows: their means agree, and each window's mean equals a plain cross-entropy."""
    vbf = _script("val_by_file")
    model = _model()
    ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    total, count = vbf.doc_loss(model, ids, seq_len=64)  # windows of 64, 64 and 21 predictions
    losses, argmax = vbf.token_losses(model, ids, seq_len=64)
    assert count == 149 and losses.shape == (149,) and argmax.shape == (149,)
    assert math.isclose(float(losses.mean()), total / count, rel_tol=1e-5)
    tokens = torch.tensor(ids)
    with torch.no_grad():
        logits = model(tokens[None, :64], tokens[None, 1:65], return_logits=True).logits[0].float()
    assert torch.allclose(losses[:64], torch.nn.functional.cross_entropy(logits, tokens[1:65], reduction="none"),
                          atol=1e-5)
    assert torch.equal(argmax[:64], logits.argmax(-1))


def test_an_untrained_model_scores_both_copies_near_ln_vocab():
    """A freshly initialised model has no induction heads: both copies cost about ln(V) nats, and alike."""
    ctc = _script("in_context_copy")
    first, second = ctc.copy_losses(_model(), vocab_size=512, length=40, sequences=8)
    assert abs(first - math.log(512)) < 0.5 and abs(second - math.log(512)) < 0.5
    assert abs(second - first) < 0.1
