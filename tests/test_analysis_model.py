"""The cost model against the real model: FLOPs (FlopCounterMode), parameter counts (exact), saved-activation
bytes (saved_tensors_hooks, within 10%)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moetrain.analysis.activations import model_activations
from moetrain.analysis.flops import step_flops, total_flops
from moetrain.analysis.params import count_params
from moetrain.analysis.saved import saved_bytes_per_block
from moetrain.analysis.shape import ModelShape
from moetrain.config import build_config
from moetrain.configlib import from_dict, merge
from moetrain.model.config import ModelConfig
from moetrain.model.transformer import MoETransformer, count_parameters


def _config(moe: dict | None = None, execution: dict | None = None, bta_tiles: int = 1, **kw) -> ModelConfig:
    base = dict(vocab_size=96, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=40, max_seq_len=32)
    base.update(kw)
    moe = merge({"num_experts": 4, "top_k": 2, "experts": {"ffn_hidden": 24}}, moe or {})
    return from_dict(ModelConfig, {**base, "moe": moe, "execution": {**(execution or {}), "bta_tiles": bta_tiles}})


LOOP = {"moe_backend": "loop"}
CASES = {
    "dense": dict(moe_every=0),
    "moe": dict(execution=LOOP),
    "moe-qknorm-untied": dict(qk_norm="head", tie_embeddings=False, execution=LOOP, moe={"num_experts": 8,
                                                                                         "top_k": 3}),
    "mixed-layers": dict(n_layers=3, moe_every=2, qk_norm="full", execution=LOOP),
    "many-experts": dict(execution=LOOP, moe={"num_experts": 32, "top_k": 4, "experts": {"ffn_hidden": 8}}),
    "shared-expert": dict(execution=LOOP, moe={"shared_expert": {"ffn_hidden": 20, "gate": True}}),
    "padded-capacity": dict(execution={"moe_backend": "padded"},
                            moe={"capacity": {"factor": 1.5, "pad_to_capacity": True}}),
}
# Activation bytes of the capacity buffers depend on the padded backend's internals, not modelled per tensor.
MEMORY_CASES = [name for name in CASES if name != "padded-capacity"]
# The fused backend (the default) and recomputed experts save different tensors; FLOPs are the same maths (the
# FLOP test above keeps to the loop backend, whose matmuls FlopCounterMode sees).
CASES_MEMORY_ONLY = {
    "fused": dict(execution={"moe_backend": "fused"}),
    "fused-recompute": dict(execution={"moe_backend": "fused", "recompute_experts": True}),
    "loop-recompute": dict(execution={"moe_backend": "loop", "recompute_experts": True}),
    "fused-gelu-recompute": dict(execution={"moe_backend": "fused", "recompute_experts": True},
                                 moe={"experts": {"activation": "gelu"}}),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tiles", [1, 2])
def test_flops_match_flop_counter(name, tiles):
    """FlopCounterMode counts neither ``grouped_mm`` nor PyTorch's fused CPU attention kernel (both report 0), so the
    reference run uses the ``loop`` expert backend and the ``math`` SDPA backend, whose matmuls it does count."""
    cfg = _config(**CASES[name], bta_tiles=tiles)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    b, s = 4, 16
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
        model(ids, ids).loss.backward()
    measured = counter.get_total_flops()
    predicted = total_flops(step_flops(ModelShape.from_config(cfg), b, s, bta_tiles=tiles))
    assert predicted == pytest.approx(measured, rel=0.02)


def test_grouped_mm_is_invisible_to_flop_counter():
    """Why the test above uses the loop backend: documents the counter's blind spot (if PyTorch adds a formula,
    this fails and the comparison can move to grouped_mm)."""
    x = torch.randn(8, 16)
    w = torch.randn(2, 16, 4)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.grouped_mm(x, w, offs=torch.tensor([4, 8], dtype=torch.int32))
    assert counter.get_total_flops() == 0


@pytest.mark.parametrize("name", list(CASES))
def test_parameter_counts_exact(name):
    cfg = _config(**CASES[name])
    model = MoETransformer(cfg)
    counts = count_params(ModelShape.from_config(cfg))
    total, active = count_parameters(model)
    assert counts.total == total == sum(p.numel() for p in model.parameters())
    assert counts.active == active


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "cpu-small"])
def test_parameter_counts_of_presets(preset):
    cfg = build_config(preset).model
    with torch.device("meta"):
        model = MoETransformer(cfg)
    counts = count_params(ModelShape.from_config(cfg))
    total, active = count_parameters(model)
    assert counts.total == total == sum(p.numel() for p in model.parameters())
    assert counts.active == active


@pytest.mark.parametrize("name", MEMORY_CASES + list(CASES_MEMORY_ONLY))
@pytest.mark.parametrize("tiles", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("fused_loss", [False, True])
def test_saved_activation_bytes_per_block_within_10_percent(name, tiles, dtype, fused_loss):
    cfg = _config(**{**CASES, **CASES_MEMORY_ONLY}[name], bta_tiles=tiles)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    b, s = 4, 32
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        measured = saved_bytes_per_block(model, ids, ids, return_logits=not fused_loss)
    flags = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    predicted = model_activations(ModelShape.from_config(cfg), flags, b, s, tiles,
                                  act_bytes=2 if dtype == "bf16" else 4, fused_loss=fused_loss)
    for i, (p, m) in enumerate(zip(predicted.blocks, measured.blocks)):
        assert p == pytest.approx(m, rel=0.10), f"block {i}: predicted {p:.0f} B, measured {m} B"
    assert predicted.other == pytest.approx(measured.other, rel=0.10)
    assert predicted.transient == pytest.approx(measured.tile_recompute, rel=0.10)
    assert predicted.peak == pytest.approx(measured.peak, rel=0.10)
