"""Resharding: a checkpoint of the FSDP2 + pipeline engine saved at ``pp=2, ep=2`` (4 gloo ranks, through the
``Checkpointer``) resumes at ``dp_shard=2`` (2 ranks), at ``ep=4`` (4 ranks, FSDP2 on) and in one process with the
same losses for the next two steps (1e-5): the first depends on the weights, the second on the AdamW moments and
the LR schedule as well."""

from __future__ import annotations

import pytest
import torch

from _parallel_util import spawn
from moetrain.model.transformer import MoETransformer
from moetrain.parallel.engine import ShardedHooks
from moetrain.parallel.layout import Layout, build_layout_mesh
from moetrain.parallel.meta_init import build_meta, init_parameters
from moetrain.parallel.pipeline_runner import PipelineRunner
from moetrain.train.checkpointer import Checkpointer
from moetrain.train.schedule import build_scheduler
from moetrain.train.state import TrainState
from moetrain.train.step import train_step
from moetrain.train.trainer import build_optimizer
from test_fsdp_train import batches, sampler, small_config

ACCUM = 2


def _config(parallel: dict):
    return small_config(parallel, grad_accum=ACCUM)


def _save_pp2_ep2(rank: int, world: int, out_dir, url: str) -> list[float]:
    """Step 1, checkpoint, then steps 2 and 3: their losses."""
    cfg = _config({"pp": 2, "ep": 2})
    mesh = build_layout_mesh(Layout.from_config(cfg.parallel, world), 60, torch.device("cpu"))
    hooks = ShardedHooks(mesh, cfg.parallel, seed=cfg.train.seed)
    runner = PipelineRunner(build_meta(cfg.model), mesh, cfg.parallel, ACCUM, seed=cfg.train.seed, stats=hooks.stats)
    opt = build_optimizer(runner.local, cfg)
    sched = build_scheduler(opt, cfg.train)
    data = hooks.local_batch(sampler(batches(cfg, 3 * ACCUM)))
    losses = []
    for step in range(3):
        result = runner.train_step(data, opt, sched, cfg.train, hooks.reduce_mean, hooks.count_reducer)
        losses.append(float(result.lm_loss))
        if step == 0:
            Checkpointer(url, layout=runner.layout).save(TrainState(runner.local, opt, sched, step=1))
    return losses


def _resume(rank: int, world: int, out_dir, url: str, parallel: dict) -> list[float]:
    """Load the checkpoint into this layout, then steps 2 and 3: their losses."""
    cfg = _config(parallel)
    mesh = build_layout_mesh(Layout.from_config(cfg.parallel, world), 60, torch.device("cpu"))
    hooks = ShardedHooks(mesh, cfg.parallel, seed=cfg.train.seed + 1)  # different init: the load must overwrite
    model = hooks.prepare_model(build_meta(cfg.model))
    return _continue(model, cfg, url, hooks.layout, hooks.local_batch, hooks.step_kwargs())


def _continue(model, cfg, url, layout, local_batch, kwargs) -> list[float]:
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg.train)
    state = TrainState(model, opt, sched)
    checkpointer = Checkpointer(url, layout=layout)
    ckpt, _ = checkpointer.latest()
    checkpointer.load(ckpt, state)
    assert state.step == 1
    data = local_batch(sampler(batches(cfg, 3 * ACCUM)[ACCUM:]))
    return [float(train_step(model, data, opt, sched, cfg.train, torch.device("cpu"), **kwargs).lm_loss)
            for _ in range(2)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    url = str(root / "checkpoints")
    losses = spawn(_save_pp2_ep2, 4, root / "save", url, timeout_s=300)
    assert all(r == losses[0] for r in losses)
    return url, losses[0]


@pytest.mark.parametrize("world,parallel", [(2, {"dp_shard": 2}), (4, {"ep": 4, "fsdp": "on"})],
                         ids=["dp_shard2", "ep4"])
def test_pp2_ep2_checkpoint_resumes_sharded(saved, tmp_path, world, parallel):
    url, want = saved
    for got in spawn(_resume, world, tmp_path, url, parallel, timeout_s=300):
        print(parallel, got, want[1:])
        assert max(abs(a - b) for a, b in zip(got, want[1:])) <= 1e-5, (got, want)


def test_pp2_ep2_checkpoint_resumes_in_one_process(saved):
    url, want = saved
    cfg = _config({})
    model = MoETransformer(cfg.model)
    init_parameters(model, cfg.model, seed=123)
    from moetrain.parallel.dcp import ShardLayout

    got = _continue(model, cfg, url, ShardLayout.single(), lambda f: f, {})
    print("one process", got, want[1:])
    assert max(abs(a - b) for a, b in zip(got, want[1:])) <= 1e-5, (got, want)
