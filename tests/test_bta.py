"""Batch Tiling on Attention: equal to the untiled model, less attention memory, clear validation errors."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from moetrain.analysis.saved import saved_bytes_per_block, tile_attention_bytes
from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.execution import ExecutionConfig
from moetrain.model.config import ModelConfig
from moetrain.model.generate import generate
from moetrain.model.transformer import MoETransformer
from moetrain.moe.config import CapacityConfig, ExpertsConfig, MoEConfig, SharedExpertConfig


def _config(bta_tiles=1, moe_every=1, backend="fused", **moe) -> ModelConfig:
    return ModelConfig(
        vocab_size=128, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=32,
        moe_every=moe_every, qk_norm="head",
        moe=MoEConfig(**{"num_experts": 4, "top_k": 2, "experts": ExpertsConfig(ffn_hidden=24), **moe}),
        execution=ExecutionConfig(moe_backend=backend, bta_tiles=bta_tiles),
    )


def _pair(tiles, **kw):
    torch.manual_seed(0)
    ref = MoETransformer(_config(1, **kw))
    bta = MoETransformer(_config(tiles, **kw))
    bta.load_state_dict(ref.state_dict())
    return ref, bta


def _batch(b=4, s=16, vocab=128):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)


LAYERS = {
    "dropless": dict(backend="grouped_mm"),
    "loop": dict(backend="loop"),
    "dense-and-moe": dict(moe_every=2),
    # Capacity 1.0 with 4 experts drops tokens: the MoE layer sees all tokens at once, as untiled, so it drops
    # the same ones.
    "capacity": dict(backend="padded", capacity=CapacityConfig(factor=1.0)),
    "shared-expert": dict(shared_expert=SharedExpertConfig(ffn_hidden=16, gate=True)),
}


@pytest.mark.parametrize("tiles", [1, 2, 4])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_outputs_and_gradients_equal_untiled(tiles, layer):
    ref, bta = _pair(tiles, **LAYERS[layer])
    ids, tgt = _batch()
    out_ref, out_bta = ref(ids, tgt), bta(ids, tgt)
    out_ref.loss.backward()
    out_bta.loss.backward()
    torch.testing.assert_close(out_bta.logits, out_ref.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out_bta.aux_loss, out_ref.aux_loss, atol=1e-6, rtol=0)
    for r, b in zip(out_ref.moe, out_bta.moe):
        torch.testing.assert_close(b.tokens_per_expert, r.tokens_per_expert, atol=0, rtol=0)
    for (name, p_ref), p_bta in zip(ref.named_parameters(), bta.parameters()):
        torch.testing.assert_close(p_bta.grad, p_ref.grad, atol=1e-5, rtol=0, msg=name)


def test_bf16_autocast_close_to_untiled():
    ref, bta = _pair(4)
    ids, tgt = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, out_bta = ref(ids, tgt), bta(ids, tgt)
    out_ref.loss.backward()
    out_bta.loss.backward()
    # Same bf16 kernels on tiles of the batch; only the per-tile cos/sin and reduction orders may differ.
    torch.testing.assert_close(out_bta.loss, out_ref.loss, atol=2e-3, rtol=0)
    for p_ref, p_bta in zip(ref.parameters(), bta.parameters()):
        torch.testing.assert_close(p_bta.grad, p_ref.grad, atol=2e-3, rtol=2e-2)


def test_kv_cache_generation_unchanged():
    ref, bta = _pair(4)
    prompt = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(2))  # 3 does not divide by 4
    out_ref = generate(ref, prompt, 6, temperature=0.0)
    out_bta = generate(bta, prompt, 6, temperature=0.0)
    assert torch.equal(out_ref, out_bta)


def test_attention_saved_bytes_shrink_by_tiles():
    """Counted with saved_tensors_hooks: the tiled forward keeps none of the attention's activations (a block's
    saved bytes drop by exactly the untiled attention's), and one tile, recomputed in backward, holds 1/G of them."""
    ids, tgt = _batch(b=8, s=32)
    for tiles in (2, 4):
        ref, bta = _pair(tiles)
        base = saved_bytes_per_block(ref, ids, tgt)
        tiled = saved_bytes_per_block(bta, ids, tgt)
        x = ref.embed_tokens(ids).detach().requires_grad_()
        block = ref.blocks[0]
        full = tile_attention_bytes(block, x, ref.parameters())
        tile = tile_attention_bytes(block, x[: 8 // tiles].clone(), ref.parameters())
        assert tiled.blocks[0] == base.blocks[0] - full
        assert tiled.tile_recompute == tile
        # The per-call cos/sin tables ([S, Hd] each) do not shrink with the batch; everything else does.
        assert full / tile == pytest.approx(tiles, rel=0.03)


def test_one_tile_alive_at_a_time():
    """Weak references to the storage of each attention call's output (saved by SDPA and o_proj for backward): in
    the tiled forward none survives; in backward each tile's recomputation finds every earlier one freed."""
    ref, bta = _pair(4)
    ids, tgt = _batch(b=8)
    for model, alive_after_forward in ((ref, 2), (bta, 0)):
        refs: list[weakref.ref] = []
        alive_at_call: list[int] = []

        def hook(module, args):
            alive_at_call.append(sum(r() is not None for r in refs))
            refs.append(weakref.ref(args[0].untyped_storage()))

        handles = [b.attn.o_proj.register_forward_pre_hook(hook) for b in model.blocks]
        out = model(ids, tgt)
        assert sum(r() is not None for r in refs) == alive_after_forward
        n_forward = len(alive_at_call)
        out.loss.backward()
        for h in handles:
            h.remove()
        if model is bta:
            assert n_forward == 2 * 4 and len(alive_at_call) == 2 * 2 * 4  # every tile recomputed once
            assert alive_at_call[n_forward:] == [0] * (2 * 4)


def test_tiles_must_divide_micro_batch():
    with pytest.raises(ConfigError, match=r"model\.execution\.bta_tiles: 4 attention tiles .* train\.batch_size=6"):
        build_config("tiny", overrides={"model": {"execution": {"bta_tiles": 4}}, "train": {"batch_size": 6}})
    with pytest.raises(ConfigError, match=r"model\.execution\.bta_tiles: must be >= 1"):
        build_config("tiny", overrides={"model": {"execution": {"bta_tiles": 0}}})
    assert build_config("tiny", overrides={"model": {"execution": {"bta_tiles": 4}}}).model.execution.bta_tiles == 4
    _, bta = _pair(4)
    ids, tgt = _batch(b=6)
    with pytest.raises(ConfigError,
                       match=r"model\.execution\.bta_tiles: 4 attention tiles do not divide .* 6 sequences"):
        bta(ids, tgt)
    with torch.no_grad():  # evaluation never tiles: any batch works
        bta(ids, tgt)


def test_default_is_untiled():
    assert ModelConfig().execution.bta_tiles == 1
    assert dataclasses.replace(_config().execution, bta_tiles=2).bta_tiles == 2
