"""``model.dropout``: residual and embedding dropout (GPT-2 / nanoGPT), against a plain re-implementation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.model.transformer import MoETransformer


def _model(dropout: float, moe_every: int = 1) -> MoETransformer:
    cfg = build_config("tiny", overrides={"model": {"dropout": dropout, "moe_every": moe_every}}).model
    torch.manual_seed(0)
    return MoETransformer(cfg)


def _reference_hidden(model: MoETransformer, ids: torch.Tensor, p: float) -> torch.Tensor:
    """The trunk by hand: every dropout call in the model's own order, so one seed draws the same masks."""
    x = F.dropout(model.embed_tokens(ids), p, True)
    for block in model.blocks:
        h = x + F.dropout(block.attn(block.input_norm(x)), p, True)
        y = block.ffn(block.post_attn_norm(h))
        y = y[0] if block.is_moe else y
        x = h + F.dropout(y, p, True)
    return model.norm(x)


@pytest.mark.parametrize("moe_every", [1, 0])
def test_training_forward_equals_hand_written_dropout(moe_every):
    p = 0.3
    model = _model(p, moe_every).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    torch.manual_seed(123)
    logits = model(ids).logits
    torch.manual_seed(123)
    with torch.no_grad():
        expected = model.lm_head(_reference_hidden(model, ids, p))
    torch.testing.assert_close(logits, expected)
    torch.manual_seed(7)
    assert not torch.allclose(model(ids).logits, logits)  # other masks, other output: dropout is on


def test_eval_mode_is_the_model_without_dropout():
    with_dropout, without = _model(0.5).eval(), _model(0.0).eval()
    without.load_state_dict(with_dropout.state_dict())
    ids = torch.randint(0, with_dropout.config.vocab_size, (2, 16))
    torch.testing.assert_close(with_dropout(ids).logits, without(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_out_of_range_dropout_names_the_field(value):
    with pytest.raises(ConfigError, match=r"model\.dropout.*\[0, 1\)"):
        build_config("tiny", overrides={"model": {"dropout": value}})
