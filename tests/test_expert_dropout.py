"""``model.moe.experts.dropout``: dropout on the routed experts' combined output, before the shared expert is added
(issue 19's ablation of Switch Transformer's expert dropout), against a hand-written reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.moe.layer import MoELayer


def _layers(p: float) -> tuple[MoELayer, MoELayer]:
    """The same weights with and without expert dropout; both with a shared expert."""
    moe = build_config("tiny", overrides={"model": {"moe": {"shared_expert": {"ffn_hidden": 16},
                                                            "experts": {"dropout": p}}}}).model.moe
    torch.manual_seed(0)
    with_dropout = MoELayer(32, moe)
    for param in with_dropout.parameters():  # MoETransformer.reset_parameters initialises weights
        torch.nn.init.normal_(param, std=0.1)
    without = MoELayer(32, dataclasses.replace(moe, experts=dataclasses.replace(moe.experts, dropout=0.0)))
    without.load_state_dict(with_dropout.state_dict())
    return with_dropout, without


def test_training_output_drops_the_routed_sum_only():
    p = 0.4
    layer, plain = _layers(p)
    x = torch.randn(2, 8, 32)
    torch.manual_seed(5)
    y, _ = layer.train()(x)
    with torch.no_grad():
        routed = plain.train()(x)[0] - plain.shared_expert(x)  # the routed experts' weighted sum
        torch.manual_seed(5)
        expected = F.dropout(routed, p, True) + plain.shared_expert(x)
    torch.testing.assert_close(y, expected)
    zeroed = (y - plain.shared_expert(x)).abs() < 1e-7
    assert 0.2 < zeroed.float().mean().item() < 0.6  # about p of the elements, a shared-expert-only output there


def test_eval_output_is_the_layer_without_dropout():
    layer, plain = _layers(0.5)
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(layer.eval()(x)[0], plain.eval()(x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_out_of_range_names_the_field(value):
    with pytest.raises(ConfigError, match=r"model\.moe\.experts\.dropout: must be in \[0, 1\)"):
        build_config("tiny", overrides={"model": {"moe": {"experts": {"dropout": value}}}})
