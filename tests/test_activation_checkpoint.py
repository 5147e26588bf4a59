"""Activation checkpointing (moetrain.parallel.ac): gradients with ``full`` and ``selective`` checkpointing equal
those without, alone and with BTA tiles and router jitter (random numbers replayed in the recompute); parameter
names are unchanged; the recompute really happens (forward hooks of a checkpointed module run again in backward,
and :func:`in_recompute` tells them apart), for the experts of every backend (the fused one included)."""

from __future__ import annotations

import copy

import pytest
import torch

from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.model.transformer import MoETransformer
from moetrain.moe.experts import BACKENDS
from moetrain.parallel import ac


def _model(tiles: int = 1, jitter: float = 0.0, backend: str = "loop", dtype=torch.float64) -> MoETransformer:
    cfg = build_config("tiny", overrides={"model": {
        "hidden": 16, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "vocab_size": 64,
        "moe": {"num_experts": 4, "top_k": 2, "experts": {"ffn_hidden": 16}, "router": {"jitter_eps": jitter},
                "losses": {"aux_loss_coeff": 0.01, "seq_aux_loss_coeff": 0.01, "z_loss_coeff": 0.01}},
        "execution": {"moe_backend": backend, "bta_tiles": tiles}}})
    torch.manual_seed(0)
    return MoETransformer(cfg.model).to(dtype)


def _grads(model: MoETransformer, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (4, 9), generator=gen)
    torch.manual_seed(seed)  # router jitter draws from the global RNG
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("tiles,jitter", [(1, 0.0), (2, 0.0), (1, 0.1)])
def test_checkpointed_gradients_equal_plain(mode, tiles, jitter):
    plain = _model(tiles, jitter)
    checked = copy.deepcopy(plain)
    names = ac.apply(checked, mode)
    assert names, "something must be checkpointed"
    assert [n for n, _ in checked.named_parameters()] == [n for n, _ in plain.named_parameters()]
    want, got = _grads(plain), _grads(checked)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_selective_recomputes_the_experts_of_every_backend(backend):
    # Every backend runs inside the experts module, the fused one's dispatch + experts + combine included, so the
    # one ``selective`` switch recomputes them all (fp32: grouped_mm has no fp64 kernel).
    plain = _model(backend=backend, dtype=torch.float32)
    checked = copy.deepcopy(plain)
    assert "blocks.0.ffn.experts" in ac.apply(checked, "selective")
    calls = []
    checked.blocks[0].ffn.experts.register_forward_pre_hook(lambda m, i: calls.append(ac.in_recompute()))
    want, got = _grads(plain), _grads(checked)
    assert calls == [False, True]  # the forward, then its recompute in backward
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_recompute_runs_and_is_recognisable():
    model = _model()
    ac.apply(model, "full")
    seen = []
    model.blocks[0].ffn.router.register_forward_hook(lambda m, i, o: seen.append(ac.in_recompute()))
    _grads(model)
    # The forward, then its recompute inside backward (which stops early, after the last tensor backward needs:
    # the MoE layer's own hook may or may not run again, hence the monitor's in_recompute guard).
    assert seen == [False, True]


def test_selective_with_bta_leaves_attention_to_bta():
    model = _model(tiles=2)
    names = ac.apply(model, "selective")
    assert names == ["blocks.0.ffn.experts", "blocks.1.ffn.experts"]


def test_unknown_mode_names_the_field():
    with pytest.raises(ConfigError, match="parallel.activation_checkpoint: unknown mode 'some'"):
        ac.apply(_model(), "some")
