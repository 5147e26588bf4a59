"""moetrain's RMSNorm against torch.nn.RMSNorm and transformers' MixtralRMSNorm: outputs, gradients, saved bytes."""

import pytest
import torch
from torch import nn

from moetrain.analysis.saved import SavedTensorCounter
from moetrain.model.norm import RMSNorm


def _pair(dim, eps=1e-5):
    ours, ref = RMSNorm(dim, eps), nn.RMSNorm(dim, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(0)))
        ref.weight.copy_(ours.weight)
    return ours, ref


@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 33)])
def test_rmsnorm_equals_torch_fp32(shape):
    ours, ref = _pair(shape[-1])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3
    up = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    got, want = [], []
    for norm, out in ((ours, got), (ref, want)):
        xs = x.clone().requires_grad_()
        y = norm(xs)
        (y * up).sum().backward()
        out += [y.detach(), xs.grad, norm.weight.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rmsnorm_gradcheck_float64():
    norm = RMSNorm(6).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)),
                                    (x, norm.weight.detach().clone().requires_grad_()))


def test_rmsnorm_bf16_input_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

    ours = RMSNorm(16, 1e-6)
    hf = MixtralRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        hf.weight.copy_(ours.weight)
    x = torch.randn(5, 16).to(torch.bfloat16)
    # transformers: fp32 internals, then weight (fp32) * normed.to(input dtype); ours casts once at the end.
    torch.testing.assert_close(ours(x).float(), hf(x).float(), atol=2e-2, rtol=2e-2)
    assert ours(x).dtype == torch.bfloat16


def test_rmsnorm_saves_input_and_rstd_only():
    ours, ref = _pair(32)
    x = torch.randn(8, 32, requires_grad=True)
    counts = {}
    for name, norm in (("ours", ours), ("torch", ref)):
        with SavedTensorCounter(exclude=[x, norm.weight]) as counter:
            norm(x)
        counts[name] = counter.total
    assert counts["ours"] == 8 * 4  # rstd [8, 1] fp32; x itself is the caller's
    assert counts["torch"] >= 8 * 32 * 4  # at least x * rstd on top


def test_rmsnorm_second_derivative_raises_and_meta_device_works():
    norm = RMSNorm(4)
    x = torch.randn(3, 4, requires_grad=True)
    (g,) = torch.autograd.grad(norm(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()  # once_differentiable: no silently wrong double backward
    meta = RMSNorm(8).to("meta")
    assert meta(torch.empty(2, 8, device="meta")).shape == (2, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_backward_leaves_the_incoming_gradient_alone(dtype):
    # backward builds dx in place; it must not write into the upstream gradient (another branch may hold it).
    norm = RMSNorm(16)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    up = torch.randn(4, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    kept = up.clone()
    norm(x).backward(up)
    assert torch.equal(up, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_without_gradients_equals_the_autograd_forward(dtype):
    """Generation and serving (no gradients) skip the autograd Function: the same values, bit for bit, also under
    bf16 autocast (where the norm still computes in fp32)."""
    norm = _pair(64)[0]
    x = (torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        with_grad = norm(x.clone().requires_grad_())
        with torch.no_grad():
            plain = norm(x)
        with torch.inference_mode():
            inference = norm(x)
    assert with_grad.grad_fn is not None and plain.grad_fn is None
    assert with_grad.dtype == plain.dtype == inference.dtype == dtype
    assert torch.equal(with_grad.detach(), plain) and torch.equal(plain, inference)
