"""Issue 3: our MoE layer equals transformers' MoE blocks on random weights (fp32, tolerance 1e-5): Mixtral,
Qwen3-MoE (with and without norm_topk_prob), Qwen2-MoE (sigmoid-gated shared expert), DeepSeek-V3 (sigmoid scores,
group-limited routing, e_score_correction_bias, routed scaling, shared experts); and our pooled aux loss equals
transformers' ``load_balancing_loss_func`` (with and without an attention mask, over several layers)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from moetrain.execution import ExecutionConfig  # noqa: E402
from moetrain.moe.config import ExpertsConfig, MoEConfig, RouterConfig, SharedExpertConfig  # noqa: E402
from moetrain.moe.layer import MoELayer  # noqa: E402
from moetrain.moe.losses import pooled_load_balancing_loss  # noqa: E402

D, F, E = 16, 8, 8
TOL = 1e-5


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _load_from_hf(ours: MoELayer, hf: torch.nn.Module) -> None:
    """Copy an HF sparse-MoE block's weights into our layer (names differ only in the router and shared expert)."""
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        shared = getattr(hf, "shared_expert", None) or getattr(hf, "shared_experts", None)
        if shared is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(ours.shared_expert, name).weight.copy_(getattr(shared, name).weight)
        if getattr(hf, "shared_expert_gate", None) is not None:
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
        bias = getattr(hf.gate, "e_score_correction_bias", None)
        if bias is not None:
            ours.router.e_score_correction_bias.copy_(bias)


def _compare(ours: MoELayer, hf: torch.nn.Module, backend_check: bool = True) -> None:
    ours.eval()
    hf.eval()
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(x.clone())
        expected = expected[0] if isinstance(expected, tuple) else expected
        y, aux = ours(x)
    assert (y - expected).abs().max().item() <= TOL
    # The pooled aux loss of this single layer equals transformers' load_balancing_loss_func on its logits.
    if backend_check:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        ref = load_balancing_loss_func((aux.router_logits,), E, ours.config.top_k)
        ours_loss = pooled_load_balancing_loss(aux.tokens_per_expert[None], aux.prob_sum[None], aux.num_tokens[None])
        assert abs(ours_loss.item() - float(ref)) <= TOL


def test_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                             num_experts_per_tok=2, router_jitter_noise=0.0))
    _randomize(hf, 0)
    ours = MoELayer(D, MoEConfig(num_experts=E, top_k=2, experts=ExpertsConfig(ffn_hidden=F),
                                 router=RouterConfig(norm_topk_prob=True)))
    _load_from_hf(ours, hf)
    _compare(ours, hf)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                               num_experts_per_tok=3, norm_topk_prob=norm_topk_prob))
    _randomize(hf, 1)
    ours = MoELayer(D, MoEConfig(num_experts=E, top_k=3, experts=ExpertsConfig(ffn_hidden=F),
                                 router=RouterConfig(norm_topk_prob=norm_topk_prob)))
    _load_from_hf(ours, hf)
    _compare(ours, hf)


@pytest.mark.parametrize("backend", ["grouped_mm", "padded", "loop"])
def test_qwen2_moe_block_with_gated_shared_expert(backend):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                               num_experts_per_tok=2, norm_topk_prob=False,
                                               shared_expert_intermediate_size=12))
    _randomize(hf, 2)
    ours = MoELayer(D, MoEConfig(num_experts=E, top_k=2, experts=ExpertsConfig(ffn_hidden=F),
                                 router=RouterConfig(norm_topk_prob=False),
                                 shared_expert=SharedExpertConfig(ffn_hidden=12, gate=True)),
                    ExecutionConfig(moe_backend=backend))
    _load_from_hf(ours, hf)
    _compare(ours, hf)


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (2, 1), (1, 1)])
def test_deepseek_v3_block(n_group, topk_group):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=3,
                           n_group=n_group, topk_group=topk_group, n_shared_experts=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    hf = DeepseekV3MoE(cfg)
    _randomize(hf, 3)
    with torch.no_grad():  # a bias large enough to change the selection
        hf.gate.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(4)) * 0.2)
    ours = MoELayer(D, MoEConfig(num_experts=E, top_k=3, experts=ExpertsConfig(ffn_hidden=F),
                                 router=RouterConfig(score_func="sigmoid", norm_topk_prob=True,
                                                     routed_scaling_factor=2.5, num_groups=n_group,
                                                     topk_groups=topk_group, expert_bias=True),
                                 shared_expert=SharedExpertConfig(ffn_hidden=2 * F)))
    _load_from_hf(ours, hf)
    _compare(ours, hf, backend_check=False)  # transformers has no aux loss for DeepSeek-V3


def test_pooled_aux_loss_equals_transformers_over_layers_with_mask():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(5)
    layers = [MoELayer(D, MoEConfig(num_experts=E, top_k=2, experts=ExpertsConfig(ffn_hidden=F))) for _ in range(3)]
    for i, layer in enumerate(layers):
        _randomize(layer, 10 + i)
    x = torch.randn(2, 6, D, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    for attention_mask in (None, mask):
        records = [layer(x, attention_mask)[1] for layer in layers]
        ours = pooled_load_balancing_loss(torch.stack([r.tokens_per_expert for r in records]),
                                          torch.stack([r.prob_sum for r in records]),
                                          torch.stack([r.num_tokens for r in records]))
        ref = load_balancing_loss_func(tuple(r.router_logits for r in records), E, 2, attention_mask)
        assert abs(ours.item() - ref.item()) <= TOL
        # Same gradient with respect to the router weights.
        g_ours = torch.autograd.grad(ours, [layer.router.weight for layer in layers], retain_graph=True)
        g_ref = torch.autograd.grad(ref, [layer.router.weight for layer in layers])
        for a, b in zip(g_ours, g_ref):
            assert (a - b).abs().max().item() <= TOL
