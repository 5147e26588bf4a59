"""Gate-output smoothing (model.moe.losses.entropy_loss_coeff): the entropy-deficit loss against values derived
by hand, and its place in the model's losses."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import build_config
from moetrain.model.transformer import MoETransformer
from moetrain.moe.gate_smoothing import routing_entropy_deficit


def test_hand_derived_values():
    """E = 4, log E = log 4. Uniform gates: H = log 4, deficit 0. Two experts at 1/2: H = log 2, deficit
    1 - log 2 / log 4 = 1/2. One-hot: H = 0, deficit 1. [0.7, 0.1, 0.1, 0.1]: H = -(0.7 ln 0.7 + 0.3 ln 0.1) =
    0.249672 + 0.690776 = 0.940448, deficit 1 - 0.940448 / 1.386294 = 0.321610."""
    probs = torch.tensor([[0.25] * 4, [0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]])
    per_token = [0.0, 0.5, 1.0, 0.321610]
    for row, want in zip(probs, per_token):
        assert routing_entropy_deficit(row[None]).item() == pytest.approx(want, abs=1e-6)
    assert routing_entropy_deficit(probs).item() == pytest.approx(sum(per_token) / 4, abs=1e-6)
    # padding does not count: the one-hot token masked out
    mask = torch.tensor([True, True, False, True])
    assert routing_entropy_deficit(probs, mask).item() == pytest.approx((0.0 + 0.5 + 0.321610) / 3, abs=1e-6)
    # sigmoid scores are normalised first: equal scores are uniform gates whatever their size
    assert routing_entropy_deficit(torch.full((2, 4), 0.3)).item() == pytest.approx(0.0, abs=1e-6)
    assert routing_entropy_deficit(torch.ones(3, 1)).item() == 0.0  # one expert: nothing to smooth
    assert 1 - 0.940448 / math.log(4) == pytest.approx(0.321610, abs=1e-6)


def test_model_reports_it_and_weights_it_into_moe_loss():
    coeff = 0.3
    losses = dict(aux_loss_coeff=0.0, z_loss_coeff=0.0, entropy_loss_coeff=coeff)
    cfg = build_config("tiny", overrides={"model": {"moe": {"losses": losses}}}).model
    torch.manual_seed(0)
    model = MoETransformer(cfg).train()
    ids = torch.randint(0, 512, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    out = model(ids, ids, padding_mask=mask)
    # independent recomputation from the router logits the layers report (softmax router)
    want = torch.stack([routing_entropy_deficit(torch.softmax(r.router_logits, -1), mask) for r in out.moe]).mean()
    assert out.entropy_loss.item() == pytest.approx(want.item(), abs=1e-6)
    assert 0 < out.entropy_loss.item() < 1
    assert out.moe_loss.item() == pytest.approx(coeff * out.entropy_loss.item(), abs=1e-6)
    # its gradient raises the gates' entropy: one small step along -grad lowers the deficit
    out.entropy_loss.backward()
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.weight -= 0.5 * layer.router.weight.grad
    assert model(ids, ids, padding_mask=mask).entropy_loss.item() < out.entropy_loss.item()


def test_negative_coefficient_names_the_field():
    from moetrain.errors import ConfigError

    with pytest.raises(ConfigError, match="entropy_loss_coeff"):
        build_config("tiny", overrides={"model": {"moe": {"losses": {"entropy_loss_coeff": -1.0}}}})
