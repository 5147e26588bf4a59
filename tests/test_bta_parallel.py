"""BTA under expert parallelism (2 gloo ranks, all-to-all dispatch): the tiled model equals the untiled one on every
rank, loss and gradients, because BTA only tiles the attention and leaves the MoE layer (and its exchanges) alone."""

from __future__ import annotations

import torch

from _parallel_util import ep_mesh, spawn
from moetrain.model.config import ModelConfig
from moetrain.model.transformer import MoETransformer
from moetrain.execution import ExecutionConfig
from moetrain.moe.config import ExpertsConfig, MoEConfig
from moetrain.parallel.launch import ParallelHooks


def _worker(rank: int, world: int, out_dir) -> dict:
    mesh = ep_mesh(world)
    models = []
    for tiles in (1, 2):
        cfg = ModelConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=48,
                          max_seq_len=16, execution=ExecutionConfig(moe_backend="loop", bta_tiles=tiles),
                          moe=MoEConfig(num_experts=4, top_k=2, experts=ExpertsConfig(ffn_hidden=16)))
        torch.manual_seed(0)  # the same full weights on every rank and for both models, then sharded
        model = MoETransformer(cfg).double()
        ParallelHooks(mesh, "all_to_all").prepare_model(model)
        models.append(model)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own local batch
    ids = torch.randint(0, 64, (4, 16), generator=gen)
    tgt = torch.randint(0, 64, (4, 16), generator=gen)
    losses = []
    for model in models:
        out = model(ids, tgt)
        out.loss.backward()
        losses.append(out.loss.detach())
    grad_diff = max((a.grad - b.grad).abs().max().item()
                    for a, b in zip(models[0].parameters(), models[1].parameters()))
    return {"loss_diff": (losses[0] - losses[1]).abs().item(), "grad_diff": grad_diff}


def test_bta_with_expert_parallelism(tmp_path):
    for result in spawn(_worker, 2, tmp_path):
        assert result["loss_diff"] < 1e-12
        assert result["grad_diff"] < 1e-12
