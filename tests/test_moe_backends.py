"""The conformance suite of the expert backends (moe/experts.py ``BACKENDS``): every backend (``fused``, ``grouped_mm``,
``padded``, and any added later) agrees with the per-expert ``loop`` reference in output and gradients, through the
layer: dropless and with capacity (both policies, with and without padding), GELU, a gated shared expert, grouped
sigmoid routing, in bf16, with idle experts (exactly zero gradient), with a batch whose every token is dropped; the
backend functions alone on a capacity layout and on weights a provider hands in (idle experts left out), a lazy
weight provider (the per-expert loop, int8 weights with scales); and
grouped_mm when the grouped GEMM leaves the memory it does not own full of NaN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.execution import ExecutionConfig
from moetrain.moe.config import CapacityConfig, ExpertsConfig, MoEConfig, RouterConfig, SharedExpertConfig
from moetrain.moe.experts import BACKENDS, RoutedExperts, expert_loop
from moetrain.moe.layer import MoELayer

D, FF, E = 16, 8, 6
FAST = sorted(set(BACKENDS) - {"loop"})  # every backend but the reference


def _layer(seed: int = 0, backend: str = "fused", **kw) -> MoELayer:
    cfg = dict(num_experts=E, top_k=2, experts=ExpertsConfig(ffn_hidden=FF))
    cfg.update(kw)
    layer = MoELayer(D, MoEConfig(**cfg), ExecutionConfig(moe_backend=backend))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _run(layer: MoELayer, x: torch.Tensor, mask: torch.Tensor | None = None):
    """Output, the gradients of every parameter and of x, under a non-trivial upstream gradient."""
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y, aux = layer(x, mask)
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(99))
    ((y * up).sum() + aux.aux_loss + aux.z_loss).backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
    return y.detach(), grads, x.grad.clone(), aux


def _assert_same(a, b, tol=1e-5):
    """Equal within ``tol`` times max(1, the reference's largest magnitude)."""
    y_a, g_a, x_a, _ = a
    y_b, g_b, x_b, _ = b
    assert torch.isfinite(y_a).all() and torch.isfinite(x_a).all()

    def close(u, v, name):
        u, v = u.float(), v.float()
        assert (u - v).abs().max().item() <= tol * max(1.0, v.abs().max().item()), name

    close(y_a, y_b, "y")
    close(x_a, x_b, "x.grad")
    for name in g_b:
        assert torch.isfinite(g_a[name]).all(), name
        close(g_a[name], g_b[name], name)


SETTINGS = [
    dict(),  # dropless
    dict(experts=ExpertsConfig(ffn_hidden=FF, activation="gelu")),
    dict(capacity=CapacityConfig(factor=0.5, drop_policy="probs")),
    dict(capacity=CapacityConfig(factor=0.5, drop_policy="position")),
    dict(capacity=CapacityConfig(factor=0.75, drop_policy="probs", pad_to_capacity=True)),
    dict(capacity=CapacityConfig(factor=0.75, drop_policy="position", pad_to_capacity=True, min_capacity=3)),
    dict(capacity=CapacityConfig(factor=1.0), shared_expert=SharedExpertConfig(ffn_hidden=12, gate=True)),
    dict(router=RouterConfig(score_func="sigmoid", num_groups=3, topk_groups=2, expert_bias=True,
                             routed_scaling_factor=2.0)),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "dropless")
@pytest.mark.parametrize("backend", FAST)
def test_backend_equals_loop(settings, backend):
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    ref = _run(_layer(backend="loop", **settings), x, mask)
    got = _run(_layer(backend=backend, **settings), x, mask)
    _assert_same(got, ref)
    if "capacity" in settings and settings["capacity"].factor < 1:
        assert ref[3].dropped_per_expert.sum() > 0  # the case really drops


def _skewed_layer(backend: str, **kw) -> MoELayer:
    """Router that sends every token to experts 0 and 1 (strongly), leaving experts 2..E-1 idle."""
    layer = _layer(backend=backend, **kw)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 5.0
        layer.router.weight[1, 0] = 4.0
    return layer


@pytest.mark.parametrize("settings", [dict(), dict(capacity=CapacityConfig(factor=1.5))], ids=["dropless", "capacity"])
@pytest.mark.parametrize("backend", FAST)
def test_bf16_backend_equals_loop(settings, backend):
    # bf16 weights and inputs: every backend against the bf16 loop, within bf16's rounding (2^-8 relative per
    # operation; the fused backend applies the gating weight before the down projection).
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = _run(_layer(backend="loop", **settings).bfloat16(), x)
    got = _run(_layer(backend=backend, **settings).bfloat16(), x)
    assert got[0].dtype == torch.bfloat16
    _assert_same(got, ref, tol=4e-2)


@pytest.mark.parametrize("backend", FAST)
def test_idle_experts_get_exactly_zero_gradient(backend):
    x = torch.randn(10, D, generator=torch.Generator().manual_seed(2)).abs()  # feature 0 > 0: experts 0, 1 win
    ref = _run(_skewed_layer("loop"), x)
    got = _run(_skewed_layer(backend), x)
    _assert_same(got, ref)
    assert got[3].tokens_per_expert[2:].sum() == 0
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert got[1][name][2:].abs().max() == 0


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_token_dropped(backend):
    """Padding never takes a capacity slot: an all-padding batch drops every assignment; the layer returns exact
    zeros (only the residual carries these tokens), with finite, zero expert gradients."""
    layer = _layer(backend=backend, capacity=CapacityConfig(factor=1.0))
    x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(2, 4, dtype=torch.bool)
    y, grads, x_grad, aux = _run(layer, x, mask)
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.isfinite(x_grad).all()
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert torch.equal(grads[name], torch.zeros_like(grads[name]))
    assert aux.tokens_per_expert.sum() == 0 and aux.num_tokens == 0
    assert torch.isfinite(aux.aux_loss) and torch.isfinite(aux.seq_aux_loss)


class _NaNGroupedMM(torch.autograd.Function):
    """A worst-case grouped GEMM: correct inside its groups, NaN in every output row past the last group, in the
    input-gradient rows past it, and in the weight gradient of every empty group (memory it never writes)."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        out = torch.full((a.shape[0], b.shape[-1]), float("nan"), dtype=a.dtype)
        start = 0
        for e, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ b[e]
            start = end
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        grad_a = torch.full_like(a, float("nan"))
        grad_b = torch.full_like(b, float("nan"))
        start = 0
        for e, end in enumerate(offs.tolist()):
            grad_a[start:end] = grad[start:end] @ b[e].T
            if end > start:
                grad_b[e] = a[start:end].T @ grad[start:end]
            start = end
        return grad_a, grad_b, None


def _nan_grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    return _NaNGroupedMM.apply(a, b, offs)


@pytest.mark.parametrize("settings", [dict(), dict(capacity=CapacityConfig(factor=0.5))], ids=["dropless", "dropping"])
def test_grouped_mm_garbage_never_leaks(settings, monkeypatch):
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(4)).abs()
    ref = _run(_skewed_layer("loop", **settings), x)
    monkeypatch.setattr(F, "grouped_mm", _nan_grouped_mm)
    got = _run(_skewed_layer("grouped_mm", **settings), x)
    _assert_same(got, ref)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_backend_functions_on_capacity_layout(activation):
    """Every backend function agrees with the loop on a capacity layout (E * C rows, zero rows in empty slots)."""
    e, c, f = 4, 3, 8
    g = torch.Generator().manual_seed(5)
    w_in = (torch.randn(e, (2 if activation == "swiglu" else 1) * f, D, generator=g) * 0.3).requires_grad_()
    w_out = (torch.randn(e, D, f, generator=g) * 0.3).requires_grad_()
    x = torch.randn(e * c, D, generator=g)
    x[[2, 5, 9, 10, 11]] = 0.0  # empty slots
    counts = torch.full((e,), c)
    outs = []
    for name in ["loop"] + FAST:
        w_in.grad = w_out.grad = None
        y = BACKENDS[name].experts(x, w_in, w_out, counts, activation)
        y.square().sum().backward()
        outs.append((y.detach(), w_in.grad.clone(), w_out.grad.clone()))
    for other in outs[1:]:
        for a, b in zip(other, outs[0]):
            assert (a - b).abs().max().item() <= 1e-5
    assert outs[0][0][[2, 5, 9, 10, 11]].abs().max() == 0


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_weights_from_a_provider_may_leave_idle_experts_out(backend):
    # A weight provider (int8 copies, experts paged in) hands RoutedExperts the weights of the experts a step uses
    # only: with those experts' weights and counts alone, the rows' layout and every output are the same.
    torch.manual_seed(0)
    experts = RoutedExperts(E, D, FF, backend=backend)
    counts = torch.tensor([3, 0, 4, 0, 0, 2]) if backend != "padded" else torch.full((E,), 3)
    x = torch.randn(int(counts.sum()), D, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = experts(x, counts)
        used = (counts > 0).nonzero().flatten()
        given = experts(x, counts[used], weights=(experts.w_in[used].clone(), experts.down_proj[used].clone()))
        ref = BACKENDS["loop"].experts(x, experts.w_in, experts.down_proj, counts, "swiglu")
    torch.testing.assert_close(given, full, rtol=0, atol=0)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-6)


def test_a_lazy_weight_provider_runs_the_per_expert_loop():
    # A lazy provider (ExpertWeights) yields the used experts one at a time in its own order, possibly stored in
    # int8 with per-output-row scales: the rows equal the reference loop on the weights it stands for.
    torch.manual_seed(0)
    experts = RoutedExperts(E, D, FF, backend="fused")
    counts = torch.tensor([3, 0, 4, 0, 0, 2])
    x = torch.randn(int(counts.sum()) + 2, D, generator=torch.Generator().manual_seed(7))  # 2 rows past the groups
    s_in, s_out = torch.rand(E, 2 * FF) + 0.5, torch.rand(E, D) + 0.5
    q_in = torch.randint(-127, 128, (E, 2 * FF, D), dtype=torch.int8)
    q_out = torch.randint(-127, 128, (E, D, FF), dtype=torch.int8)
    asked = []

    def plain(used):
        asked.append(list(used))
        return ((e, experts.w_in[e], experts.down_proj[e], None, None) for e in reversed(used))

    def int8(used):
        return ((e, q_in[e], q_out[e], s_in[e], s_out[e]) for e in used)

    with torch.no_grad():
        got = expert_loop(x, counts, plain, "swiglu", torch.float32)
        want = BACKENDS["loop"].experts(x, experts.w_in, experts.down_proj, counts, "swiglu")
        got8 = expert_loop(x, counts, int8, "swiglu", torch.float32)
        want8 = BACKENDS["loop"].experts(x, q_in * s_in[..., None], q_out * s_out[..., None], counts, "swiglu")
    assert asked == [[0, 2, 5]]  # experts with rows only
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[-2:].abs().max() == 0
    torch.testing.assert_close(got8, want8, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match=r"left out experts \[2\], which have rows \(all with rows: \[0, 2, 5\]\)"):
        expert_loop(x, counts, lambda used: ((e, experts.w_in[e], experts.down_proj[e], None, None)
                                             for e in used if e != 2), "swiglu", torch.float32)


def test_the_tokens_form_is_the_fused_backends_and_asks_for_one_form():
    experts = RoutedExperts(E, D, FF, backend="loop")
    x, ids, w = torch.randn(5, D), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)
    with pytest.raises(ValueError, match="'loop' backend has no fused"):
        experts(x, topk_ids=ids, topk_weights=w)
    with pytest.raises(ValueError, match="either tokens_per_expert"):
        experts(x)
    with pytest.raises(ValueError, match="either tokens_per_expert"):
        experts(x, torch.tensor([5, 0, 0, 0, 0, 0]), topk_ids=ids, topk_weights=w)
