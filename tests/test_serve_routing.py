"""Dynamic top-k and the int8 router at inference (moetrain/serve/routing.py, moetrain/serve/moe.py), checked
against a plain per-token loop; the ``load`` policy lowering k under a burst and restoring it."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import Config
from moetrain.model.transformer import MoETransformer
from moetrain.serve.moe import StepPolicies, StepRouting
from moetrain.serve.routing import Int8Router, RoutingPolicy, tokens_k

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(score_func: str = "softmax", norm: bool = True, shared: int = 0, seed: int = 0):
    torch.manual_seed(seed)
    moe = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden": 24, "score_func": score_func,
           "norm_topk_prob": norm, "shared_expert_ffn_hidden": shared}
    # the flat (pre-split) MoE field names: Config.from_dict moves them to their sub-configs where those exist
    cfg = Config.from_dict({"model": {"vocab_size": 64, "hidden": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
                                      "ffn_hidden": 48, "max_seq_len": 32, "moe": moe},
                            "data": {"seq_len": 32}})
    model = MoETransformer(cfg.model).eval()
    layer = model.moe_layers()[0]
    with torch.no_grad():  # a router with spread-out logits, so that thresholds pick different k
        layer.router.weight.normal_(0, 0.5)
    return layer


@torch.no_grad()
def _reference(layer, x, k_min, k_max, p):
    """A plain loop: per token, experts by descending score (ties: lowest index), the fewest whose probability
    mass reaches p, clamped to [k_min, k_max]; gating weights = their scores renormalised; sum of SwiGLU experts."""
    w_router = layer.router.weight.double()
    w_in, w_out = layer.experts.gate_up_proj.double(), layer.experts.down_proj.double()
    f = w_out.shape[2]
    ys, ks = [], []
    for t in range(x.shape[0]):
        xt = x[t].double()
        logits = w_router @ xt
        scores = torch.softmax(logits, 0) if layer.config.router.score_func == "softmax" else torch.sigmoid(logits)
        probs = scores / scores.sum()
        order = sorted(range(len(scores)), key=lambda e: (-float(scores[e]), e))
        k, mass = 0, 0.0
        while k < k_max and (k < k_min or mass < p):
            mass += float(probs[order[k]])
            k += 1
        chosen = order[:k]
        gates = torch.stack([scores[e] for e in chosen])
        if layer.config.router.norm_topk_prob:
            gates = gates / gates.sum()
        y = torch.zeros_like(xt)
        for g, e in zip(gates, chosen):
            h = w_in[e] @ xt
            y += g * (w_out[e] @ (torch.nn.functional.silu(h[:f]) * h[f:]))
        ys.append(y)
        ks.append(k)
    return torch.stack(ys).float(), torch.tensor(ks)


def _policies(policy, t, depth=0):
    return StepPolicies(((policy, t),), depth)


def serve_moe(layer, x, policies):
    """The layer under the step's routing hook: (y, its MoEStepStats)."""
    routing = StepRouting(policies)
    with torch.inference_mode():
        y, aux = layer(x, routing=routing)
    assert aux is None and len(routing.stats) == 1
    return y, routing.stats[0]


@pytest.mark.parametrize("score_func,norm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_threshold_and_fixed_policies_match_a_plain_loop(score_func, norm):
    layer = _layer(score_func, norm)
    x = torch.randn(40, 32)
    for policy, (k_min, k_max, p) in [
        (RoutingPolicy(policy="threshold", p=0.5, k_min=1, k_max=4), (1, 4, 0.5)),
        (RoutingPolicy(policy="threshold", p=0.7, k_min=1, k_max=4), (1, 4, 0.7)),
        (RoutingPolicy(policy="threshold", p=0.9, k_min=2, k_max=6), (2, 6, 0.9)),
        (RoutingPolicy(policy="fixed", k=1), (1, 1, 2.0)),
        (RoutingPolicy(policy="fixed", k=3), (3, 3, 2.0)),
        (RoutingPolicy(), (2, 2, 2.0)),
    ]:
        y, stats = serve_moe(layer, x, _policies(policy, 40))
        y_ref, k_ref = _reference(layer, x, k_min, k_max, p)
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5, msg=str(policy))
        assert stats.k_used.tolist() == k_ref.tolist(), policy
        assert stats.active == int(k_ref.sum())
    # the thresholds really vary k per token
    _, stats = serve_moe(layer, x, _policies(RoutingPolicy(policy="threshold", p=0.7, k_max=4), 40))
    assert len(set(stats.k_used.tolist())) > 1


def test_default_policy_is_the_training_layer():
    layer = _layer(shared=16)
    x = torch.randn(30, 32)
    with torch.no_grad():
        y_train, aux = layer(x)
    y, stats = serve_moe(layer, x, _policies(RoutingPolicy(), 30))
    # same routing and kernels; the training layer may group the GEMM rows differently (H1's dispatcher), so
    # equal to fp32 rounding rather than bit for bit
    torch.testing.assert_close(y, y_train, rtol=1e-5, atol=1e-6)
    assert stats.counts.tolist() == aux.tokens_per_expert.long().tolist()


def test_per_request_policies_in_one_step():
    """Two requests' tokens in one batch, each with its own policy, give what each gets alone."""
    layer = _layer()
    x = torch.randn(20, 32)
    a, b = RoutingPolicy(policy="threshold", p=0.6, k_max=4), RoutingPolicy(policy="fixed", k=1)
    y, stats = serve_moe(layer, x, StepPolicies(((a, 12), (b, 8))))
    ya, sa = serve_moe(layer, x[:12], _policies(a, 12))
    yb, sb = serve_moe(layer, x[12:], _policies(b, 8))
    torch.testing.assert_close(y, torch.cat([ya, yb]), rtol=1e-5, atol=1e-6)
    assert stats.k_used.tolist() == sa.k_used.tolist() + sb.k_used.tolist()


def test_load_policy_lowers_k_with_the_queue_and_restores_it():
    policy = RoutingPolicy(policy="load", k_min=1, k_max=4, low=2, high=10)
    ks = [policy.load_k(2, 8, d) for d in range(14)]
    assert ks[:3] == [4, 4, 4] and ks[10:] == [1, 1, 1, 1]
    assert all(a >= b for a, b in zip(ks, ks[1:]))  # never rises as the queue grows
    layer = _layer()
    x = torch.randn(10, 32)
    for depth, k in [(0, 4), (4, 3), (10, 1), (0, 4)]:  # a burst, then drained
        _, stats = serve_moe(layer, x, _policies(policy, 10, depth))
        assert stats.k_used.tolist() == [k] * 10, depth


def test_tokens_k_edges():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05], [0.34, 0.33, 0.33]])
    one = torch.ones(3, dtype=torch.int64)
    assert tokens_k(probs, torch.full((3,), 0.8), one, 3 * one).tolist() == [2, 1, 3]
    assert tokens_k(probs, torch.full((3,), 0.5), one, 3 * one).tolist() == [1, 1, 2]  # mass exactly 0.5: one
    assert tokens_k(probs, torch.full((3,), 1.0), 2 * one, 2 * one).tolist() == [2, 2, 2]
    for bad in ({"policy": "nope"}, {"policy": "threshold", "p": 0.0}, {"k_min": 3, "k_max": 2}, {"k": 0},
                {"policy": "load", "low": 5, "high": 5}):
        with pytest.raises(ValueError):
            RoutingPolicy(**bad)


def test_int8_router_quantisation_error_is_bounded():
    w = torch.randn(8, 32)
    q = Int8Router(w)
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127
    # per-row symmetric rounding: the error of each weight is at most half a step of its row
    assert ((q.dequantized() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(5, 32)
    torch.testing.assert_close(q.logits(x), x @ q.dequantized().T, rtol=1e-5, atol=1e-5)
    assert q.nbytes() == 8 * 32 + 8 * 4
