"""Issue 9: the fused LM head + cross-entropy (model/fused_ce.py) equals ``F.cross_entropy(hidden @ weight.T)``.

Loss and both gradients in fp32 (several chunks, ignored targets), under bf16 autocast, fp64 ``gradcheck``; a batch
with every target ignored; and the model's ``return_logits=False`` path against its plain path (tied and untied
embeddings), which is what the trainer runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.configlib import from_dict
from moetrain.model.config import ModelConfig
from moetrain.model.fused_ce import linear_cross_entropy
from moetrain.model.transformer import MoETransformer


def _case(dtype=torch.float32, n=37, d=12, v=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100
    return hidden, weight, targets


def _loss_and_grads(fn, hidden, weight, autocast=False):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_rows", [None, 1, 8])
def test_equals_plain_cross_entropy_fp32(chunk_rows):
    hidden, weight, targets = _case()
    got = _loss_and_grads(lambda h, w: linear_cross_entropy(h, w, targets, chunk_rows), hidden, weight)
    ref = _loss_and_grads(lambda h, w: F.cross_entropy(h @ w.T, targets), hidden, weight)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_under_bf16_autocast_matches_plain_autocast_path():
    hidden, weight, targets = _case()
    got = _loss_and_grads(lambda h, w: linear_cross_entropy(h, w, targets, 8), hidden, weight, autocast=True)
    ref = _loss_and_grads(lambda h, w: F.cross_entropy(F.linear(h, w).float(), targets), hidden, weight,
                          autocast=True)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.float32  # fp32 master weight keeps fp32 grads
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=2e-2)


def test_gradcheck_fp64():
    hidden, weight, targets = _case(torch.float64, n=9, d=4, v=7)
    assert torch.autograd.gradcheck(lambda h, w: linear_cross_entropy(h, w, targets, 4),
                                    (hidden.requires_grad_(), weight.requires_grad_()))


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    hidden, weight, _ = _case()
    targets = torch.full((hidden.shape[0],), -100)
    loss, dh, dw = _loss_and_grads(lambda h, w: linear_cross_entropy(h, w, targets, 8), hidden, weight)
    assert loss.item() == 0.0 and dh.abs().max() == 0 and dw.abs().max() == 0


def test_rejects_mismatched_shapes():
    hidden, weight, targets = _case()
    with pytest.raises(ValueError, match="shapes"):
        linear_cross_entropy(hidden, weight[:, :5], targets)


@pytest.mark.parametrize("tie", [True, False])
def test_model_return_logits_false_equals_plain_path(tie):
    cfg = from_dict(ModelConfig, {"vocab_size": 61, "hidden": 16, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1,
                                  "ffn_hidden": 32, "max_seq_len": 16, "tie_embeddings": tie,
                                  "moe": {"num_experts": 4, "top_k": 2, "experts": {"ffn_hidden": 8}}}, "model")
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    ids = torch.randint(0, 61, (3, 9))
    targets = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    results = []
    for return_logits in (True, False):
        model.zero_grad(set_to_none=True)
        out = model(ids, targets, return_logits=return_logits)
        out.loss.backward()
        assert (out.logits is None) == (not return_logits)
        results.append([out.loss.detach(), out.lm_loss.detach(), out.aux_loss.detach()]
                       + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("autocast", [False, True])
def test_kept_chunk_buffers_carry_nothing_between_calls(autocast):
    """The chunk buffers are kept between calls (moe/kernels/cpu/workspace.py): a call after a larger one, with a
    different vocabulary and a last chunk shorter than the others, still equals the plain path, and a repeated call
    takes no more kept memory."""
    from moetrain.moe.kernels.cpu import workspace

    big = _case(n=64, d=16, v=53, seed=1)
    _loss_and_grads(lambda h, w: linear_cross_entropy(h, w, big[2], 40), *big[:2], autocast=autocast)
    hidden, weight, targets = _case(n=37, d=12, v=29, seed=2)
    ref = _loss_and_grads(lambda h, w: F.cross_entropy(F.linear(h, w).float(), targets), hidden, weight,
                          autocast=autocast)
    held = None
    for _ in range(2):
        got = _loss_and_grads(lambda h, w: linear_cross_entropy(h, w, targets, 16), hidden, weight, autocast=autocast)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **({"atol": 2e-2, "rtol": 2e-2} if autocast else {}))
        assert held is None or workspace.held_bytes() == held
        held = workspace.held_bytes()
