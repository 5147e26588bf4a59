"""Issue 16 defects of the MoE layer's inputs, each failing before its fix:

- ``backend=grouped_mm`` with a hidden size whose fp32 rows are not 16-byte aligned (D = 6: 24 bytes) raised
  "strides should be multiple of 16 bytes" from ``grouped_mm``; it now falls back to the loop and equals it.
- a ``padding_mask`` covering past + new tokens during cached generation raised an ``expand`` error from
  moe/losses.py; it now raises a ValueError naming ``padding_mask`` and both shapes, at the layer and the model.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config import build_config
from moetrain.execution import ExecutionConfig
from moetrain.model.attention import KVCache
from moetrain.model.transformer import MoETransformer
from moetrain.moe.config import ExpertsConfig, MoEConfig
from moetrain.moe.experts import grouped_experts, loop_experts
from moetrain.moe.layer import MoELayer


@pytest.mark.parametrize("hidden,ffn", [(6, 8), (8, 5), (7, 3)])  # D, F or both unaligned in fp32
def test_grouped_mm_backend_with_unaligned_rows_equals_the_loop(hidden, ffn):
    outs = {}
    for backend in ("grouped_mm", "loop"):
        torch.manual_seed(0)
        layer = MoELayer(hidden, MoEConfig(num_experts=4, top_k=2, experts=ExpertsConfig(ffn_hidden=ffn)),
                         ExecutionConfig(moe_backend=backend))
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y, aux = layer(x)
        (y.square().sum() + aux.aux_loss).backward()
        outs[backend] = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(outs["grouped_mm"], outs["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_experts_with_unaligned_hidden_equals_the_loop():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 6, generator=g)  # fp32 rows of 24 bytes
    w_in, w_out = torch.randn(3, 16, 6, generator=g), torch.randn(3, 6, 8, generator=g)
    counts = torch.tensor([4, 0, 3])  # 2 rows past the last group
    got = grouped_experts(x, w_in, w_out, counts)
    torch.testing.assert_close(got[:7], loop_experts(x, w_in, w_out, counts)[:7])


def _layer():
    return MoELayer(8, MoEConfig(num_experts=4, top_k=2, experts=ExpertsConfig(ffn_hidden=8)))


def test_layer_names_a_padding_mask_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"padding_mask: shape \(2, 8\) does not match the tokens' shape \(2, 1\)"):
        _layer()(torch.randn(2, 1, 8), padding_mask=torch.ones(2, 8, dtype=torch.bool))
    y, aux = _layer()(torch.randn(2, 3, 8), padding_mask=torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool))
    assert y.shape == (2, 3, 8) and float(aux.num_tokens) == 3  # a mask of the right shape still works


def test_cached_generation_with_a_past_plus_new_padding_mask_names_padding_mask():
    torch.manual_seed(0)
    model = MoETransformer(build_config("tiny").model).eval()
    ids = torch.randint(0, 500, (2, 8))
    with torch.no_grad():
        cache = KVCache(model.config.n_layers, 2, 8)
        model(ids[:, :7], kv_cache=cache, padding_mask=torch.ones(2, 7, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"padding_mask: shape \(2, 8\) .*tokens' shape \(2, 1\)"):
            model(ids[:, 7:], kv_cache=cache, padding_mask=torch.ones(2, 8, dtype=torch.bool))
