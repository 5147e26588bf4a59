"""Issue 3: hand-derived router, capacity and loss values ("balanced = K" transformers convention unless noted),
expert bias, group limits, tie-breaking, jitter, bf16 autocast and config validation."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.moe.capacity import capacity_keep, expert_capacity
from moetrain.moe.config import CapacityConfig, ExpertsConfig, MoEConfig, RouterConfig
from moetrain.moe.layer import MoELayer
from moetrain.moe.losses import (
    expert_counts,
    global_load_balancing_loss,
    pooled_load_balancing_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    utilization_loss,
)
from moetrain.moe.router import route, softmax_experts, topk_stable


def _pooled(routing, mask=None):
    """Our transformers-style pooled loss for one layer."""
    valid = torch.ones(routing.logits.shape[0]) if mask is None else mask.reshape(-1).float()
    counts = expert_counts(routing.topk_ids, routing.logits.shape[1], mask)
    return pooled_load_balancing_loss(counts[None], (routing.probs * valid[:, None]).sum(0)[None], valid.sum()[None])


def test_case1_top2_saturated_router():
    logits = torch.tensor([[10.0, 9.0, 0.0, 0.0]] * 4, requires_grad=True)
    loss = _pooled(route(logits, 2))
    # f = [1, 1, 0, 0] (sums to K), P = softmax([10, 9, 0, 0]): 4 * (p0 + p1) = 4 * (1 - 2 / (e^10 + e^9 + 2)).
    assert abs(loss.item() - 3.9997) < 5e-5
    assert abs(loss.item() - 4 * (1 - 2 / (math.exp(10) + math.exp(9) + 2))) < 1e-6
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.abs().max() > 0


def test_case2_padding_is_excluded():
    p = torch.tensor([[[0.9, 0.1], [0.9, 0.1]], [[0.1, 0.9], [0.9, 0.1]]])  # [B=2, S=2, E=2]
    logits = p.log().reshape(4, 2)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    routing = route(logits, 1)
    # Real tokens: f = (2/3, 1/3), P = (1.9/3, 1.1/3): 2 * (2/3 * 1.9/3 + 1/3 * 1.1/3) = 1.0889.
    assert abs(_pooled(routing, mask).item() - 1.0889) < 5e-5
    assert abs(_pooled(routing).item() - 1.2) < 1e-6  # if padding were counted
    # top-1: the Switch convention (balanced = 1) coincides with transformers'.
    assert abs(switch_load_balancing_loss(routing.probs, routing.topk_ids, mask).item() - 1.0889) < 5e-5


def test_case3_loss_takes_logits_softmax_once():
    logits = torch.tensor([[4.0, 0.0, 0.0, 0.0]] * 3, requires_grad=True)
    loss = _pooled(route(logits, 1))
    assert abs(loss.item() - 3.7917) < 5e-5
    (grad,) = torch.autograd.grad(loss, logits)
    assert abs(grad[:, 0].sum().item() - 0.1975) < 5e-5


def test_case4_capacity_drops_the_last_token_by_position():
    layer = MoELayer(4, MoEConfig(num_experts=4, top_k=1, experts=ExpertsConfig(ffn_hidden=4),
                                  router=RouterConfig(norm_topk_prob=False),
                                  capacity=CapacityConfig(factor=1.0, min_capacity=4, drop_policy="position")))
    torch.manual_seed(0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
        layer.experts.gate_up_proj.normal_(0, 0.5)
        layer.experts.down_proj.normal_(0, 0.5)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 5)  # router logits [1, 0, 0, 0]
    assert expert_capacity(5, 1, 4, 1.0, 4) == 4  # ceil(5 * 1 / 4 * 1.0) = 2, raised to 4
    routing = route(x @ torch.eye(4), 1, norm_topk_prob=False)
    keep = capacity_keep(routing.topk_ids, routing.topk_weights, 4, 4, "position")
    assert keep.reshape(-1).tolist() == [True, True, True, True, False]
    weight = math.e / (math.e + 3)
    assert abs(weight - 0.47537) < 5e-6
    assert torch.allclose(routing.topk_weights[:4, 0], torch.full((4,), weight))
    y, aux = layer(x)
    w1, w2 = layer.experts.gate_up_proj[0], layer.experts.down_proj[0]
    gate, up = (w1 @ x[0]).chunk(2)
    expert0 = w2 @ (torch.nn.functional.silu(gate) * up)
    assert torch.allclose(y[:4], weight * expert0.expand(4, -1), atol=1e-6)
    assert torch.equal(y[4], torch.zeros(4))  # exactly zero: only the residual carries the dropped token
    assert aux.dropped_per_expert.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert aux.capacity == 4


def test_case5_top1_renormalised_weights_are_one():
    logits = torch.tensor([[0.6, 0.4], [0.8, 0.2]]).log()
    routing = route(logits, 1, norm_topk_prob=True)
    assert routing.topk_weights.reshape(-1).tolist() == [1.0, 1.0]


def test_case6_bf16_autocast_keeps_the_fp32_choice():
    assert torch.tensor(1.001).bfloat16() == torch.tensor(1.003).bfloat16()  # bf16 would tie (expert 0 wins)
    layer = MoELayer(4, MoEConfig(num_experts=4, top_k=1, experts=ExpertsConfig(ffn_hidden=4)))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.1)
        layer.router.weight.copy_(torch.eye(4))
    x = torch.tensor([[1.001, 1.003, 0.0, 0.0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = layer.router(x)
    assert routing.logits.dtype == torch.float32
    assert routing.topk_ids.item() == 1
    assert route(x, 1).topk_ids.item() == 1  # as in fp32


def test_expert_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    for score_func in ("softmax", "sigmoid"):
        plain = route(logits, 1, score_func=score_func, norm_topk_prob=False)
        biased = route(logits, 1, score_func=score_func, norm_topk_prob=False, expert_bias=bias)
        assert plain.topk_ids.item() == 0 and biased.topk_ids.item() == 3
        assert biased.topk_weights.item() == pytest.approx(plain.scores[0, 3].item())  # unbiased score


def test_expert_bias_buffer_is_saved_and_updated():
    layer = MoELayer(8, MoEConfig(num_experts=4, top_k=1, experts=ExpertsConfig(ffn_hidden=8),
                                  router=RouterConfig(expert_bias=True, expert_bias_update_rate=0.01)))
    assert "router.e_score_correction_bias" in layer.state_dict()
    assert "router.e_score_correction_bias" not in dict(layer.named_parameters())
    layer.router.update_expert_bias(torch.tensor([6.0, 2.0, 4.0, 0.0]))  # mean 3
    assert torch.allclose(layer.router.e_score_correction_bias, torch.tensor([-0.01, 0.01, -0.01, 0.01]))
    no_bias = MoELayer(8, MoEConfig(num_experts=4, top_k=1, experts=ExpertsConfig(ffn_hidden=8)))
    assert not any("bias" in name for name in no_bias.state_dict())


def test_masked_groups_never_win():
    # Sigmoid scores: group 0 = (0.95, 0.01) sums to 0.96 < group 1 = (0.6, 0.6) = 1.2; the single best expert (0)
    # is in the losing group and must not be chosen, not even as a second choice.
    scores = torch.tensor([[0.95, 0.01, 0.6, 0.6]])
    logits = torch.log(scores / (1 - scores))
    routing = route(logits, 2, score_func="sigmoid", num_groups=2, topk_groups=1)
    assert sorted(routing.topk_ids.reshape(-1).tolist()) == [2, 3]
    assert route(logits, 2, score_func="sigmoid").topk_ids.reshape(-1).tolist()[0] == 0  # without the limit


def test_ties_go_to_the_lowest_index():
    routing = route(torch.zeros(3, 6), 2)
    assert routing.topk_ids.tolist() == [[0, 1]] * 3
    keep = capacity_keep(torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1), 2, 3, "probs")
    assert keep.reshape(-1).tolist() == [True, True, True, False, False]


def _topk_by_stable_sort(scores, k):
    """The reference: a stable descending sort, the first K (ties to the lowest index)."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


@pytest.mark.parametrize("shape, k", [((64, 8), 2), ((64, 8), 1), ((32, 64), 8), ((16, 4, 16), 2), ((8, 6), 6)])
def test_topk_stable_equals_a_stable_sort_with_ties_and_minus_inf(shape, k):
    g = torch.Generator().manual_seed(0)
    for scores in (torch.rand(shape, generator=g),  # no ties
                   torch.randint(0, 3, shape, generator=g).float(),  # many ties
                   torch.zeros(shape, dtype=torch.float64),  # all equal (a zero-initialised router)
                   torch.rand(shape, generator=g).masked_fill(torch.rand(shape, generator=g) < 0.7, float("-inf"))):
        values, indices = topk_stable(scores, k)
        ref_values, ref_indices = _topk_by_stable_sort(scores, k)
        assert torch.equal(indices, ref_indices) and torch.equal(values, ref_values)
        assert (indices.sort(dim=-1).values.diff(dim=-1) > 0).all()  # no expert twice, even among -inf rows


@pytest.mark.parametrize("experts", [4, 8, 15, 16, 64])
def test_softmax_over_experts_equals_torch_softmax(experts):
    logits = torch.randn(300, experts, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(300, experts, generator=torch.Generator().manual_seed(2))
    ours = softmax_experts(logits)
    (d_ours,) = torch.autograd.grad(ours, logits, grad)
    ref = torch.softmax(logits, dim=-1)
    (d_ref,) = torch.autograd.grad(ref, logits, grad)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-7)
    torch.testing.assert_close(d_ours, d_ref, rtol=1e-5, atol=1e-7)


def test_jitter_only_in_training():
    layer = MoELayer(8, MoEConfig(num_experts=4, top_k=2, experts=ExpertsConfig(ffn_hidden=8),
                                  router=RouterConfig(jitter_eps=0.1)))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(6, 8)
    layer.eval()
    assert torch.equal(layer.router(x).logits, layer.router(x).logits)
    layer.train()
    assert not torch.equal(layer.router(x).logits, layer.router(x).logits)


def test_sequence_aux_loss_against_a_loop():
    g = torch.Generator().manual_seed(0)
    b, s, e, k = 3, 5, 4, 2
    routing = route(torch.randn(b * s, e, generator=g), k)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2] = False  # an all-padding sequence is left out of the mean
    ours = sequence_load_balancing_loss(routing.probs.reshape(b, s, e), routing.topk_ids.reshape(b, s, k), mask)
    expected = []
    for i in range(2):
        rows = [i * s + j for j in range(s) if mask[i, j]]
        f = torch.zeros(e)
        for r in rows:
            for ex in routing.topk_ids[r].tolist():
                f[ex] += 1.0 / (k * len(rows))
        p = routing.probs[rows].mean(0)
        expected.append(e * float((f * p).sum()))  # balanced = 1 (DeepSeek-V3 eq. 17-20)
    assert abs(ours.item() - sum(expected) / 2) < 1e-6


def test_balanced_routing_conventions():
    e, k = 4, 2
    t = 8
    probs = torch.full((t, e), 1.0 / e)
    ids = (torch.arange(t)[:, None] + torch.arange(k)[None, :]) % e
    counts = expert_counts(ids, e)
    assert switch_load_balancing_loss(probs, ids).item() == pytest.approx(1.0)
    assert pooled_load_balancing_loss(counts[None], probs.sum(0)[None], torch.tensor([float(t)])).item() == \
        pytest.approx(k)
    assert sequence_load_balancing_loss(probs[None], ids[None]).item() == pytest.approx(1.0)
    assert global_load_balancing_loss(probs.sum(0), torch.tensor(float(t)), counts).item() == pytest.approx(1.0)
    assert utilization_loss(probs).item() == 0.0


def test_utilization_loss_value_and_gradient_at_balance():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    mean = 1 / 3
    expected = math.sqrt(((0.5 - mean) ** 2 + (0.3 - mean) ** 2 + (0.2 - mean) ** 2) / 3)
    assert utilization_loss(probs).item() == pytest.approx(expected, abs=1e-7)
    logits = torch.zeros(4, 3, requires_grad=True)  # exact balance: a zero, finite gradient
    (grad,) = torch.autograd.grad(utilization_loss(route(logits, 1).probs), logits)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("override,field", [
    ({"capacity": {"factor": 0.0}}, "model.moe.capacity.factor"),
    ({"capacity": {"factor": -1.0}}, "model.moe.capacity.factor"),
    ({"top_k": 9}, "model.moe.top_k"),
    ({"router": {"num_groups": 3}}, "model.moe.router.num_groups"),
    ({"router": {"num_groups": 2, "topk_groups": 3}}, "model.moe.router.topk_groups"),
    ({"router": {"num_groups": 4, "topk_groups": 1}, "top_k": 3}, "model.moe.top_k"),
    ({"capacity": {"eval_factor": 0.0, "factor": 1.0}}, "model.moe.capacity.eval_factor"),
    ({"capacity": {"pad_to_capacity": True}}, "model.moe.capacity.pad_to_capacity"),
    ({"shared_expert": {"gate": True}}, "model.moe.shared_expert.gate"),
    ({"router": {"score_func": "relu"}}, "model.moe.router.score_func"),
    ({"capacity": {"min_capacity": 0, "factor": 1.0}}, "model.moe.capacity.min_capacity"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        build_config("tiny", overrides={"model": {"moe": {"num_experts": 8, **override}}})
    assert str(err.value).startswith(field), str(err.value)


def test_eval_capacity_factor_applies_in_eval_mode_only():
    layer = MoELayer(8, MoEConfig(num_experts=4, top_k=1, experts=ExpertsConfig(ffn_hidden=8),
                                  capacity=CapacityConfig(factor=0.5, eval_factor=4.0)))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    _, train_aux = layer.train()(x)
    _, eval_aux = layer.eval()(x)
    assert train_aux.capacity == 2 and train_aux.dropped_per_expert.sum() > 0  # ceil(16 / 4 * 0.5)
    assert eval_aux.capacity == 16 and eval_aux.dropped_per_expert.sum() == 0  # ceil(16 / 4 * 4), capped at T


def test_zero_coefficient_losses_are_reported_without_a_graph():
    """A loss whose coefficient is 0 keeps its value (statistics) but builds no autograd graph, and moe_loss is the
    sum of the positive-coefficient terms only (by hand)."""
    from moetrain.model.transformer import MoETransformer

    cfg = build_config("tiny", overrides={"model": {"moe": {"losses": {
        "aux_loss_coeff": 0.01, "z_loss_coeff": 0.0, "seq_aux_loss_coeff": 0.0, "util_loss_coeff": 0.0,
        "entropy_loss_coeff": 0.0, "pooled_aux_loss_coeff": 0.0, "global_aux_loss_coeff": 0.0}}}}).model
    torch.manual_seed(0)
    model = MoETransformer(cfg).train()
    out = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    rec = out.moe[0]
    assert rec.aux_loss.requires_grad
    for name in ("z_loss", "seq_aux_loss", "util_loss", "entropy_loss"):
        value = getattr(rec, name)
        assert not value.requires_grad and torch.isfinite(value) and value > 0, name
    torch.testing.assert_close(out.moe_loss, 0.01 * out.aux_loss)
    assert out.moe_loss.requires_grad


def test_routing_tensors_are_not_views():
    """The router may be an FSDP2 unit of its own (parallel/fsdp.py), whose outputs must not be views."""
    for experts in (4, 8, 16):
        routing = route(torch.randn(12, experts, requires_grad=True), 2)
        for name in ("logits", "scores", "probs", "topk_ids", "topk_weights"):
            assert getattr(routing, name)._base is None, (experts, name)
