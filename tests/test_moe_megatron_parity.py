"""Issue 3: our router, capacity and balancing losses equal Megatron-Core's ``moe_utils`` (imported on CPU):
``topk_routing_with_score_function`` (softmax before/after top-k, sigmoid, expert bias, groups, scaling),
``apply_router_token_dropping`` (probs / position policy, with and without padding to capacity),
``get_capacity``, ``switch_load_balancing_loss_func`` (per batch, per sequence, global batch), ``z_loss_func``,
``compute_routing_scores_for_aux_loss`` and ``get_updated_expert_bias``.

Megatron ranks tokens for dropping with ``torch.topk(..., sorted=False)``, whose choice among equal values is
unspecified (CPU returns e.g. positions [1, 5, 4] for the top 3 of six equal values), so its "position" policy does
not keep the earliest tokens on CPU. The dropping tests therefore run Megatron's function with ``torch.topk``
replaced by a stable top-k (ties to the lowest index, the policy's documented intent); everything else is Megatron's
own code.
"""

from __future__ import annotations

import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on CPU
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

from moetrain.moe.capacity import capacity_keep, expert_capacity  # noqa: E402
from moetrain.moe.dispatch import LocalDispatcher  # noqa: E402
from moetrain.moe.losses import (  # noqa: E402
    expert_counts,
    global_load_balancing_loss,
    router_z_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
)
from moetrain.moe.router import route  # noqa: E402

T, E = 24, 8


def _logits(seed: int, t: int = T, e: int = E) -> torch.Tensor:
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 2


def _dense(routing, e: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [T, K] routing as Megatron's dense (routing_probs [T, E], routing_map [T, E] bool)."""
    t = routing.topk_ids.shape[0]
    probs = torch.zeros(t, e).scatter(1, routing.topk_ids, routing.topk_weights)
    rmap = torch.zeros(t, e, dtype=torch.bool).scatter(1, routing.topk_ids, True)
    return probs, rmap


def _stable_topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - torch.topk's signature
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


ROUTING_CASES = [
    # (name, megatron kwargs, our kwargs)
    ("softmax-then-topk", dict(topk=2, use_pre_softmax=True), dict(top_k=2, norm_topk_prob=False)),
    ("topk-then-softmax", dict(topk=2, use_pre_softmax=False), dict(top_k=2, norm_topk_prob=True)),
    ("softmax-top1-renorm", dict(topk=1, use_pre_softmax=False), dict(top_k=1, norm_topk_prob=True)),
    ("softmax-scaled", dict(topk=3, use_pre_softmax=True, scaling_factor=2.0),
     dict(top_k=3, norm_topk_prob=False, routed_scaling_factor=2.0)),
    ("softmax-groups", dict(topk=4, use_pre_softmax=True, num_groups=4, group_topk=2),
     dict(top_k=4, norm_topk_prob=False, num_groups=4, topk_groups=2)),
    ("sigmoid", dict(topk=2, score_function="sigmoid"), dict(top_k=2, score_func="sigmoid", norm_topk_prob=True)),
    ("sigmoid-top1", dict(topk=1, score_function="sigmoid"), dict(top_k=1, score_func="sigmoid", norm_topk_prob=False)),
    ("sigmoid-bias-groups-scaled",
     dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, bias=True),
     dict(top_k=4, score_func="sigmoid", norm_topk_prob=True, num_groups=4, topk_groups=2,
          routed_scaling_factor=2.5, bias=True)),
]


@pytest.mark.parametrize("name,mkw,okw", ROUTING_CASES, ids=[c[0] for c in ROUTING_CASES])
def test_routing_probs_and_map(name, mkw, okw):
    logits = _logits(0)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.3
    mkw, okw = dict(mkw), dict(okw)
    m_bias = bias if mkw.pop("bias", False) else None
    o_bias = bias if okw.pop("bias", False) else None
    m_probs, m_map = mu.topk_routing_with_score_function(logits, expert_bias=m_bias, **mkw)
    ours = route(logits, expert_bias=o_bias, **okw)
    o_probs, o_map = _dense(ours)
    assert torch.equal(o_map, m_map)
    assert (o_probs - m_probs).abs().max().item() <= 1e-6


def test_group_limited_routing_changes_the_choice():
    """The group cases above are not vacuous: limiting groups changes the routing map of these logits."""
    logits = _logits(0)
    limited = _dense(route(logits, 4, norm_topk_prob=False, num_groups=4, topk_groups=2))[1]
    free = _dense(route(logits, 4, norm_topk_prob=False))[1]
    assert not torch.equal(limited, free)


def test_aux_loss_scores_and_map():
    logits = _logits(2)
    for score_func in ("softmax", "sigmoid"):
        m_map, m_scores = mu.compute_routing_scores_for_aux_loss(logits, 2, score_func)
        ours = route(logits, 2, score_func=score_func)
        assert (ours.probs - m_scores).abs().max().item() <= 1e-6
        assert torch.equal(_dense(ours)[1], m_map)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("top_k,factor,norm", [(2, 0.5, False), (2, 1.0, True), (1, 0.75, True), (3, 5.0, False)])
def test_token_dropping(policy, pad, top_k, factor, norm, monkeypatch):
    logits = _logits(3)
    ours = route(logits, top_k, norm_topk_prob=norm)  # top-1 renormalised: every weight is 1.0 (all ties)
    probs, rmap = _dense(ours)
    with monkeypatch.context() as m:
        m.setattr(torch, "topk", _stable_topk)
        m_probs, m_map = mu.apply_router_token_dropping(probs, rmap, top_k, factor, policy, pad)
    capacity = expert_capacity(T, top_k, E, factor)
    keep = capacity_keep(ours.topk_ids, ours.topk_weights, E, capacity, policy)
    kept_probs = torch.zeros(T, E).scatter(1, ours.topk_ids, ours.topk_weights * keep)
    kept_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, ours.topk_ids, keep)
    assert torch.equal(kept_probs, m_probs)
    if not pad:
        assert torch.equal(kept_map, m_map)
    else:
        # Megatron pads each expert to C rows with zero-probability tokens; we pad with zero rows. The real
        # assignments and the rows per expert agree.
        assert torch.equal(kept_map, m_map & rmap)
        _, tokens_per_expert, _ = LocalDispatcher(E).dispatch(torch.zeros(T, 4), ours.topk_ids, ours.topk_weights,
                                                             keep=keep, capacity=capacity)
        assert torch.equal(tokens_per_expert, m_map.sum(dim=0))
    if factor < 1:
        assert not keep.all()  # the case really drops


def test_capacity_formula():
    for t, k, e, f, mn in [(24, 2, 8, 1.0, None), (24, 2, 8, 1.25, None), (5, 1, 4, 1.0, 4), (100, 8, 64, 0.3, 2),
                           (7, 3, 5, 1.1, None)]:
        expected = mu.get_capacity(t * k, e, f, mn)
        assert expert_capacity(t, k, e, f, mn) == min(expected, t)


def test_switch_loss_and_gradient_with_padding():
    logits = _logits(4).requires_grad_()
    valid = torch.rand(T, generator=torch.Generator().manual_seed(5)) > 0.3
    for mask in (None, valid):
        ours = route(logits, 2)
        loss = switch_load_balancing_loss(ours.probs, ours.topk_ids, mask)
        counts = expert_counts(ours.topk_ids, E, mask)
        n = T if mask is None else int(mask.sum())
        ref = mu.switch_load_balancing_loss_func(ours.probs, counts, n, 2, E, 1.0, padding_mask=mask)
        assert abs(loss.item() - ref.item()) <= 1e-6
        g_ours, = torch.autograd.grad(loss, logits, retain_graph=True)
        g_ref, = torch.autograd.grad(ref, logits)
        assert (g_ours - g_ref).abs().max().item() <= 1e-7


def test_sequence_aux_loss_is_megatron_switch_per_sequence():
    b, s, k = 3, 8, 2
    logits = _logits(6, b * s)
    ours = route(logits, k, score_func="sigmoid")
    loss = sequence_load_balancing_loss(ours.probs.reshape(b, s, E), ours.topk_ids.reshape(b, s, k))
    ref = torch.stack([
        mu.switch_load_balancing_loss_func(ours.probs.reshape(b, s, E)[i], expert_counts(
            ours.topk_ids.reshape(b, s, k)[i], E), s, k, E, 1.0)
        for i in range(b)
    ]).mean()
    assert abs(loss.item() - ref.item()) <= 1e-6


def test_global_aux_loss_is_megatron_global_formula():
    """Megatron's global aux loss on micro-batch m is ``switch_load_balancing_loss_func(probs_m, global counts,
    global tokens)``, and their sum is the large-batch loss; ours averages micro-batch losses to the same value."""
    k, g = 2, 3
    logits = _logits(7, T * g)
    whole = route(logits, k)
    global_counts = expert_counts(whole.topk_ids, E)
    parts = [route(chunk, k) for chunk in logits.chunk(g)]
    ref = sum(mu.switch_load_balancing_loss_func(p.probs, global_counts, T * g, k, E, 1.0) for p in parts)
    ours = torch.stack([global_load_balancing_loss(p.probs.sum(0), torch.tensor(float(T)), global_counts)
                        for p in parts]).mean()
    assert abs(ours.item() - ref.item()) <= 1e-6
    assert abs(ours.item() - switch_load_balancing_loss(whole.probs, whole.topk_ids).item()) <= 1e-6


def test_z_loss_with_padding():
    logits = _logits(8) * 3
    valid = torch.arange(T) % 3 != 0
    assert abs(router_z_loss(logits).item() - mu.z_loss_func(logits, 1.0).item()) <= 1e-4
    # Megatron's z_loss_func takes the inverted mask (True = padding).
    ours, ref = router_z_loss(logits, valid), mu.z_loss_func(logits, 1.0, padding_mask=~valid)
    assert abs(ours.item() - ref.item()) <= 1e-5 * max(1.0, ref.item())


def test_expert_bias_update(tmp_path, monkeypatch):
    """Megatron's ``get_updated_expert_bias`` all-reduces the counts; run it in a one-process gloo group."""
    import torch.distributed as dist

    from moetrain.moe.balancing import expert_bias_delta

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        monkeypatch.setattr(mu.parallel_state, "get_tensor_and_data_parallel_group",
                            lambda with_context_parallel=False: dist.group.WORLD)
        counts = torch.tensor([5.0, 0.0, 3.0, 3.0, 9.0, 1.0, 3.0, 0.0])  # mean 3: expert 2, 3, 6 exactly balanced
        bias = torch.randn(E)
        ref = mu.get_updated_expert_bias(counts.clone(), bias, 1e-3)
        assert torch.equal(bias + expert_bias_delta(counts, 1e-3), ref)
    finally:
        dist.destroy_process_group()
