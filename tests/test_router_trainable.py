"""Top-1 with renormalised gating weights leaves the router without a language-model gradient: the premise, shown
on the layer itself, and the one-line refusal of ``moetrain train`` / ``moetrain compare`` (config.py
``check_router_trainable``), while loading such a config and Switch-style top-1 stay allowed."""

from __future__ import annotations

import pytest
import torch

from moetrain.cli import main
from moetrain.config import build_config, check_router_trainable
from moetrain.errors import ConfigError
from moetrain.moe.config import AuxLossConfig, ExpertsConfig, MoEConfig, RouterConfig
from moetrain.moe.layer import MoELayer

MESSAGE = "model.moe.router.norm_topk_prob: true with model.moe.top_k=1 renormalises every gating weight to 1"


def _router_grad(top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """The router weight's gradient from an output-only loss (no aux loss, no z-loss) of a 4-expert layer."""
    torch.manual_seed(0)
    config = MoEConfig(num_experts=4, top_k=top_k, experts=ExpertsConfig(ffn_hidden=8),
                       router=RouterConfig(norm_topk_prob=norm_topk_prob),
                       losses=AuxLossConfig(aux_loss_coeff=0.0, z_loss_coeff=0.0))
    layer = MoELayer(8, config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    y, _ = layer(torch.randn(2, 6, 8))
    y.square().sum().backward()
    grad = layer.router.weight.grad
    assert grad is not None
    return grad


def test_top1_renormalised_router_gets_no_lm_gradient():
    switch = _router_grad(1, False).abs().max()  # Switch: weight = router probability
    assert switch > 1e-2
    assert _router_grad(1, True).abs().max() < 1e-5 * switch  # p / p = 1: float round-off only
    assert _router_grad(2, True).abs().max() > 1e-2 * switch  # top-2 renormalised: the two weights still move


def test_check_names_the_field_only_for_the_untrainable_case():
    with pytest.raises(ConfigError, match="^" + MESSAGE):
        check_router_trainable(build_config("tiny", overrides={"model": {"moe": {"top_k": 1}}}))
    for moe in ({"top_k": 1, "router": {"norm_topk_prob": False}}, {"top_k": 2}):
        check_router_trainable(build_config("tiny", overrides={"model": {"moe": moe}}))
    dense = {"moe_every": 0, "moe": {"top_k": 1}}  # no MoE layer: nothing to route
    check_router_trainable(build_config("tiny", overrides={"model": dense}))


def test_train_and_compare_refuse_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--out", str(out), "model.moe.top_k=1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"moetrain: error: {MESSAGE}"), err
    assert not out.exists()
    cmp = tmp_path / "cmp"
    assert main(["compare", "k1:model.moe.top_k=1", "--out", str(cmp), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"moetrain: error: variant 'k1': {MESSAGE}"), err
    assert not cmp.exists()
