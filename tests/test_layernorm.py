"""model.norm = layernorm: the norm against a value derived by hand, its place in the model, and HF export refused
naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.model.norm import LayerNorm, RMSNorm
from moetrain.model.transformer import MoETransformer


def test_layernorm_hand_derived_value():
    """x = [1, 2, 3, 4]: mean 2.5, biased variance 1.25, so x_hat = [-3, -1, 1, 3] / (2 sqrt(1.25)) =
    [-1.3416408, -0.4472136, 0.4472136, 1.3416408]; with weight [2, 1, 1, 0.5] and bias [0, 1, 0, -1]:
    y = [-2.6832816, 0.5527864, 0.4472136, -0.3291796]."""
    norm = LayerNorm(4, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, 1.0, 1.0, 0.5]))
        norm.bias.copy_(torch.tensor([0.0, 1.0, 0.0, -1.0]))
    a = 1.5 / math.sqrt(1.25)
    b = 0.5 / math.sqrt(1.25)
    want = torch.tensor([-2 * a, 1 - b, b, 0.5 * a - 1])
    assert want.tolist() == pytest.approx([-2.6832816, 0.5527864, 0.4472136, -0.3291796], abs=1e-7)
    torch.testing.assert_close(norm(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))[0], want, rtol=0, atol=1e-6)


def test_layernorm_keeps_bf16_dtype_and_computes_in_fp32():
    x = torch.randn(3, 8).to(torch.bfloat16)
    norm = LayerNorm(8)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, norm(x.float()).to(torch.bfloat16), rtol=0, atol=0)


def test_model_norm_selects_the_norm_and_layernorm_removes_the_mean():
    cfg = build_config("tiny", overrides={"model": {"norm": "layernorm"}}).model
    model = MoETransformer(cfg)
    norms = [m for m in model.modules() if isinstance(m, (LayerNorm, RMSNorm))]
    assert sum(isinstance(m, LayerNorm) for m in norms) == 2 * cfg.n_layers + 1  # 2 per block + final
    assert all(m.bias.abs().sum() == 0 and (m.weight == 1).all() for m in norms if isinstance(m, LayerNorm))
    x = torch.randn(2, 5, cfg.hidden) + 3.0
    assert model.norm(x).mean(-1).abs().max() < 1e-5  # centred; RMSNorm would keep the offset
    assert RMSNorm(cfg.hidden)(x).mean(-1).abs().min() > 0.5
    default = MoETransformer(build_config("tiny").model)
    assert not any(isinstance(m, LayerNorm) for m in default.modules())


def test_bad_norm_value_names_the_field():
    with pytest.raises(ConfigError, match="model.norm"):
        build_config("tiny", overrides={"model": {"norm": "batchnorm"}})


def test_hf_export_of_layernorm_refused_naming_the_field():
    from moetrain.interop.families import family_for

    cfg = build_config("tiny", overrides={"model": {"norm": "layernorm"}}).model
    with pytest.raises(ConfigError, match=r"model\.norm.*layernorm"):
        family_for(cfg)
    family_for(build_config("tiny").model)  # the RMSNorm twin exports
