"""Issue-2 ladder of references for the MoE layer: grouped GEMM == per-expert loop; 1 expert top-1 == dense
SwiGLU; balanced routing gives a Switch loss of exactly 1.0 for any k."""

from __future__ import annotations

import torch

from moetrain.model.ffn import SwiGLU
from moetrain.moe.config import ExpertsConfig, MoEConfig
from moetrain.moe.experts import grouped_experts, loop_experts
from moetrain.moe.layer import MoELayer
from moetrain.moe.losses import switch_load_balancing_loss


def _weights(e: int, d: int, f: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(e, 2 * f, d, generator=g) * 0.2
    w2 = torch.randn(e, d, f, generator=g) * 0.2
    return w1.requires_grad_(), w2.requires_grad_()


def test_grouped_mm_equals_loop_including_empty_experts():
    e, d, f = 6, 16, 24
    counts = torch.tensor([5, 0, 3, 0, 9, 1])  # experts 1 and 3 receive no tokens
    x = torch.randn(int(counts.sum()), d, requires_grad=True)
    up = torch.randn(int(counts.sum()), d)  # a non-trivial upstream gradient
    results = []
    for fn in (grouped_experts, loop_experts):
        w1, w2 = _weights(e, d, f)
        x.grad = None
        y = fn(x, w1, w2, counts)
        (y * up).sum().backward()
        results.append((y.detach(), x.grad.clone(), w1.grad.clone(), w2.grad.clone()))
    for a, b in zip(*results):
        assert (a - b).abs().max() <= 1e-5
    # Idle experts get exactly zero gradient.
    w1_grad = results[0][2]
    assert w1_grad[1].abs().max() == 0 and w1_grad[3].abs().max() == 0


def test_grouped_mm_plain_sum_backward():
    """``y.sum().backward()`` hands grouped_mm a stride-0 gradient; the layer must accept it."""
    w1, w2 = _weights(3, 8, 8)
    x = torch.randn(7, 8, requires_grad=True)
    grouped_experts(x, w1, w2, torch.tensor([2, 0, 5])).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_one_expert_top1_equals_dense_swiglu():
    d, f = 32, 48
    layer = MoELayer(d, MoEConfig(num_experts=1, top_k=1, experts=ExpertsConfig(ffn_hidden=f)))
    dense = SwiGLU(d, f)
    with torch.no_grad():
        for p in list(layer.parameters()) + list(dense.parameters()):
            p.normal_(0, 0.1)
        layer.experts.gate_up_proj.copy_(torch.cat([dense.gate_proj.weight, dense.up_proj.weight])[None])
        layer.experts.down_proj.copy_(dense.down_proj.weight[None])
    x = torch.randn(2, 5, d)
    y, aux = layer(x)
    assert (y - dense(x)).abs().max() <= 1e-6
    assert aux.tokens_per_expert.tolist() == [10.0]


def _loop_layer_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token reference: softmax, top-k, renormalise, weighted sum of expert SwiGLUs."""
    w_r = layer.router.weight
    w1, w2 = layer.experts.gate_up_proj, layer.experts.down_proj
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ w_r.T, dim=-1)
        top = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))[: layer.config.top_k]
        total = sum(float(probs[i]) for i in top)
        for i in top:
            gate, up = (w1[i] @ x[t]).chunk(2)
            out[t] += float(probs[i]) / total * (w2[i] @ (torch.nn.functional.silu(gate) * up))
    return out


@torch.no_grad()
def test_layer_equals_token_loop():
    torch.manual_seed(0)
    layer = MoELayer(16, MoEConfig(num_experts=5, top_k=2, experts=ExpertsConfig(ffn_hidden=12)))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(11, 16)
    y, _ = layer(x)
    assert (y - _loop_layer_reference(layer, x)).abs().max() <= 1e-5


def test_switch_loss_balanced_is_one_for_any_k():
    for e, k in [(4, 1), (4, 2), (8, 2), (8, 3)]:
        t = e * 6
        probs = torch.full((t, e), 1.0 / e)
        # Token t picks experts t, t+1, ..., t+k-1 (mod E): every expert gets exactly t*k/E assignments.
        ids = (torch.arange(t)[:, None] + torch.arange(k)[None, :]) % e
        assert switch_load_balancing_loss(probs, ids).item() == 1.0


def test_switch_loss_hand_value_and_padding():
    # 4 experts, top-1, 3 tokens with logits [4, 0, 0, 0]: p0 = e^4 / (e^4 + 3); all tokens pick expert 0.
    # Normalised loss = E * f0 * P0 = 4 * 1 * p0; transformers' convention gives the same here (k = 1).
    logits = torch.tensor([[4.0, 0, 0, 0]] * 3, requires_grad=True)
    probs = torch.softmax(logits, -1)
    loss = switch_load_balancing_loss(probs, probs.argmax(-1, keepdim=True))
    p0 = torch.e**4 / (torch.e**4 + 3)
    assert abs(loss.item() - 4 * p0) < 1e-6
    loss.backward()
    # d/dz0 of 4 * mean_t p0_t = 4/3 * sum_t p0 (1 - p0)
    assert abs(logits.grad[:, 0].sum().item() - 4 * p0 * (1 - p0)) < 1e-6
    # A padded token must not count: with one of four tokens padded the value equals the 3-token one.
    logits4 = torch.tensor([[4.0, 0, 0, 0]] * 3 + [[0, 0, 0, 9.0]])
    p4 = torch.softmax(logits4, -1)
    padded = switch_load_balancing_loss(p4, p4.argmax(-1, keepdim=True), torch.tensor([1, 1, 1, 0]))
    assert abs(padded.item() - loss.item()) < 1e-6
