"""An MoE layer built on its own is initialised (it held torch.empty memory: NaNs, 1e36s); inside the model the MoE
modules leave the drawing to MoETransformer.reset_parameters, so a seed's initial weights are what they were."""

from __future__ import annotations

import torch

from moetrain.config import build_config
from moetrain.model.transformer import MoETransformer
from moetrain.moe import router as router_module
from moetrain.moe import experts as experts_module
from moetrain.moe.config import ExpertsConfig, MoEConfig, SharedExpertConfig
from moetrain.moe.layer import MoELayer
from moetrain.moe.weight_init import DEFAULT_STD, deferred_init, initialise_now


def test_a_standalone_moe_layer_is_initialised_and_runs():
    torch.manual_seed(0)
    layer = MoELayer(64, MoEConfig(num_experts=8, top_k=2, experts=ExpertsConfig(ffn_hidden=128),
                                   shared_expert=SharedExpertConfig(ffn_hidden=32)))
    for name in ("router.weight", "experts.gate_up_proj", "experts.down_proj"):
        w = layer.get_parameter(name)
        assert torch.isfinite(w).all(), name
        assert abs(w.std().item() - DEFAULT_STD) < 0.1 * DEFAULT_STD and abs(w.mean().item()) < 0.1 * DEFAULT_STD
    x = torch.randn(2, 16, 64)
    y, aux = layer(x)
    assert torch.isfinite(y).all() and torch.isfinite(aux.aux_loss)
    y.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_two_standalone_layers_draw_different_weights():
    a, b = (MoELayer(16, MoEConfig(num_experts=4, top_k=2, experts=ExpertsConfig(ffn_hidden=8))) for _ in range(2))
    assert not torch.equal(a.router.weight, b.router.weight)
    assert not torch.equal(a.experts.gate_up_proj, b.experts.gate_up_proj)


def test_deferred_init_leaves_the_drawing_to_the_owner_and_nests():
    assert initialise_now()
    with deferred_init():
        assert not initialise_now()
        with deferred_init():
            assert not initialise_now()
        assert not initialise_now()
        state = torch.get_rng_state()
        MoELayer(16, MoEConfig(num_experts=4, top_k=2, experts=ExpertsConfig(ffn_hidden=8)))
        assert torch.equal(state, torch.get_rng_state())  # drew nothing
    assert initialise_now()


def test_the_models_initial_weights_do_not_depend_on_the_moe_modules_own_init(monkeypatch):
    """MoETransformer draws every tensor itself: a seed's weights and the RNG after building are the same whether
    or not the router and experts could initialise themselves (they must not consume the model's RNG stream)."""
    cfg = build_config("cpu-small").model

    def build():
        torch.manual_seed(0)
        model = MoETransformer(cfg)
        return {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()

    weights, rng = build()
    for module in (router_module, experts_module):  # as if the modules never initialised themselves
        monkeypatch.setattr(module, "initialise_now", lambda: False)
    weights_without, rng_without = build()
    assert weights.keys() == weights_without.keys()
    assert all(torch.equal(weights[k], weights_without[k]) for k in weights)
    assert torch.equal(rng, rng_without)
