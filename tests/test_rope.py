"""RoPE as one autograd Function against the composite rotate-half formula (transformers' apply_rotary_pos_emb)."""

import pytest
import torch

from moetrain.model.rope import _rotate_half, apply_rope, rope_cos_sin, rope_tables


def _reference(x, cos, sin):
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_equals_rotate_half_formula(dtype):
    b, h, s, hd = 2, 3, 5, 8
    cos, sin = rope_cos_sin(torch.arange(4, 4 + s), hd, 10000.0)
    # a transposed view, as the attention passes q and k
    base = torch.randn(b, s, h, hd, generator=torch.Generator().manual_seed(0)).to(dtype)
    up = torch.randn(b, h, s, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for fn in (apply_rope, _reference):
        leaf = base.clone().requires_grad_()
        y = fn(leaf.transpose(1, 2), cos, sin)
        (y.float() * up.float()).sum().backward()
        results.append((y.detach(), leaf.grad))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, r in zip(*results):
        assert a.dtype == r.dtype == dtype
        torch.testing.assert_close(a.float(), r.float(), atol=tol, rtol=tol)


def test_apply_rope_gradcheck_float64():
    cos, sin = rope_cos_sin(torch.arange(3), 4, 100.0)
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, cos.double(), sin.double()), (x,))


def test_rope_tables_are_cached_and_usable_for_training_after_inference_mode():
    with torch.inference_mode():
        cos, sin = rope_tables(2, 6, 8, 10000.0, "cpu")
    ref_cos, ref_sin = rope_cos_sin(torch.arange(2, 8), 8, 10000.0)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert rope_tables(2, 6, 8, 10000.0, "cpu")[0] is cos
    assert not cos.is_inference()
    x = torch.randn(1, 1, 6, 8, requires_grad=True)
    apply_rope(x, cos, sin).sum().backward()  # an inference tensor could not be saved for backward
    assert x.grad is not None


def test_apply_rope_without_gradients_equals_the_autograd_forward():
    """Generation and serving skip the autograd Function: the same values, bit for bit."""
    x = torch.randn(16, 4, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(torch.arange(30, 46), 16, 10000.0)
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, Hd]: a ragged batch's per-token positions
    with_grad = apply_rope(x.clone().requires_grad_(), cos, sin)
    with torch.inference_mode():
        plain = apply_rope(x, cos, sin)
    assert with_grad.grad_fn is not None and torch.equal(with_grad.detach(), plain)
