"""Meta-device build and per-shard initialisation (moetrain.parallel.meta_init): values depend on global indices
only, so any split of a parameter's rows (expert slices, FSDP shards, both) reproduces the rows of the whole
tensor exactly; a meta build materialised in one process equals the eager reference."""

from __future__ import annotations

import torch

from moetrain.config import build_config
from moetrain.model.transformer import MoETransformer
from moetrain.parallel.meta_init import BLOCK_ROWS, build_meta, init_parameters, materialise, normal_rows
from moetrain.parallel.layout import ParallelMesh, shard_experts


def _cfg():
    return build_config("tiny", overrides={"model": {"tie_embeddings": False,
                                                     "moe": {"router": {"expert_bias": True}}}}).model


def test_any_split_of_rows_equals_the_whole():
    shape = torch.Size((2 * BLOCK_ROWS + 37, 5))
    whole = normal_rows(7, "w", shape, 0, shape[0], 0.02)
    for cuts in ([0, 1, shape[0]], [0, BLOCK_ROWS - 3, BLOCK_ROWS + 200, shape[0]], [0, 100, 100, shape[0]]):
        parts = [normal_rows(7, "w", shape, a, b, 0.02) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), whole)
    expert = torch.Size((8, 3, 4))  # one generator per expert
    assert torch.equal(normal_rows(1, "e", expert, 5, 7, 1.0), normal_rows(1, "e", expert, 0, 8, 1.0)[5:7])
    assert whole.std().item() == __import__("pytest").approx(0.02, rel=0.1)
    assert not torch.equal(normal_rows(8, "w", shape, 0, 4, 1.0), normal_rows(7, "w", shape, 0, 4, 1.0))


def test_meta_build_holds_no_memory_and_materialises_like_the_reference():
    cfg = _cfg()
    model = build_meta(cfg)
    assert all(p.is_meta for p in model.parameters())
    materialise(model, cfg, torch.device("cpu"), seed=3)
    ref = MoETransformer(cfg)
    init_parameters(ref, cfg, seed=3)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name
    assert all(torch.count_nonzero(b) == 0 for b in model.buffers())
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(torch.all(p == 1) for p in norms)
    out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
    assert model.blocks[0].attn.o_proj.weight.std().item() < 0.8 * cfg.init_std
    assert abs(model.blocks[0].ffn.experts.down_proj.std().item() - out_std) < 0.2 * out_std


def test_expert_slices_start_equal_to_the_whole_model():
    """EP=4: rank r's meta-built experts, materialised alone, are rows [r E/4, (r+1) E/4) of the one-process
    tensors."""
    cfg = _cfg()
    ref = MoETransformer(cfg)
    init_parameters(ref, cfg, seed=0)
    full = dict(ref.named_parameters())
    for ep_rank in range(4):
        mesh = ParallelMesh(world_size=4, rank=ep_rank, ep=4, ep_rank=ep_rank, dp=1, dp_rank=0,
                            device=torch.device("cpu"))
        model = build_meta(cfg)
        plan = shard_experts(model, mesh)
        assert plan
        materialise(model, cfg, torch.device("cpu"), seed=0, plan=plan)
        for name, p in model.named_parameters():
            want = full[name]
            if name in plan:
                want = want[plan[name].offset: plan[name].offset + plan[name].local_rows]
            assert torch.equal(p, want), (ep_rank, name)
