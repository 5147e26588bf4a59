"""Distributed checkpoints (torch.distributed.checkpoint) reshard across expert-parallel sizes.

One chain through the trainer's Checkpointer, each link checked against the previous one:
  1 process trains one step and saves (the one-process format: safetensors + train_state.pt)
  -> 4 ranks (EP=4) load it, save again at EP=4 (DCP shards), take the next step
  -> 2 ranks (EP=2) load the EP=4 checkpoint, take the next step
  -> 1 process loads the EP=4 checkpoint, takes the next step;
and the 2 ranks also load the first state's one-process files as written before the optimizer state named its
parameters into their sharded model (expert tensors and AdamW moments sliced).
Every load must restore the saved parameters exactly (bit for bit), and every next step must give the loss and the
parameters of the uninterrupted single-process run (so the AdamW moments and the LR schedule were resharded and
restored too). fp32 weights, as the trainer's: the steps agree to 1e-6 (reduction order), the loads bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _parallel_util import spawn
from moetrain.config import build_config
from moetrain.errors import CheckpointError
from moetrain.model.transformer import MoETransformer
from moetrain.parallel.dcp import MARKER, ShardLayout
from moetrain.parallel.engine import ShardedHooks
from moetrain.parallel.fsdp import full_tensor
from moetrain.parallel.launch import ParallelHooks
from moetrain.parallel.layout import Layout, build_layout_mesh, gather_full, single_process
from moetrain.train.checkpoint import MODEL_FILE, STATE_FILE, LoadedCheckpoint, encode_model, encode_state
from moetrain.train.checkpointer import Checkpointer, checkpoint_format, load_latest_model, load_weights
from moetrain.train.schedule import build_scheduler
from moetrain.train.state import TrainState
from moetrain.train.step import train_step
from moetrain.train.trainer import build_optimizer

BATCH, SEQ = 4, 8


def _config(ep: int):
    # The per-micro-batch Switch loss is per rank (not global): use the global-batch one, as under DP it is exact.
    moe = {"num_experts": 4, "top_k": 2, "experts": {"ffn_hidden": 16}, "router": {"expert_bias": True},
           "losses": {"aux_loss_coeff": 0.0, "global_aux_loss_coeff": 0.01}}
    return build_config("tiny", overrides={
        "model": {"vocab_size": 64, "hidden": 16, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "moe": moe,
                  "execution": {"moe_backend": "loop"}},
        "data": {"seq_len": SEQ},
        "train": {"batch_size": BATCH, "lr": 1e-2, "warmup_steps": 3, "device": "cpu"},
        "parallel": {"ep": ep},
    })


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return b[:, :-1], b[:, 1:]


_MESHES: dict = {}  # this process's engine mesh, built once per world size


def _setup(world: int, seed: int):
    """A fresh model (initialised with ``seed``: a load must overwrite it all), sharded over ``world`` ranks (EP =
    world, on the engine) or whole in one process."""
    cfg = _config(world)
    torch.manual_seed(seed)
    model = MoETransformer(cfg.model)
    if world == 1:
        hooks = ParallelHooks(single_process())
    else:
        if world not in _MESHES:
            _MESHES[world] = build_layout_mesh(Layout.from_config(cfg.parallel, world), 60, torch.device("cpu"))
        hooks = ShardedHooks(_MESHES[world], cfg.parallel)
    hooks.prepare_model(model)
    opt = build_optimizer(model, cfg)
    return cfg, model, hooks, opt, build_scheduler(opt, cfg.train)


def _step(cfg, model, hooks, opt, sched, step: int) -> float:
    result = train_step(model, hooks.local_batch(lambda: _batch(step)), opt, sched, cfg.train, torch.device("cpu"),
                        **hooks.step_kwargs())
    return float(result.lm_loss)


def _full_params(model, hooks) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = full_tensor(p).clone()
        out[name] = gather_full(full, hooks.plan[name], hooks.mesh) if name in hooks.plan else full
    for name, b in model.named_buffers():
        if "bias" in name:
            out[name] = b.clone()
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _load(path, model, hooks, opt, sched) -> None:
    checkpointer = Checkpointer(path, hooks.layout)
    ckpt, _ = checkpointer.latest()
    checkpointer.load(ckpt, TrainState(model, opt, sched))


def _save(path, model, hooks, opt, sched) -> None:
    Checkpointer(path, hooks.layout).save(TrainState(model, opt, sched, step=1))


def _load_and_step(world: int, path, step: int):
    cfg, model, hooks, opt, sched = _setup(world, seed=99)
    _load(path, model, hooks, opt, sched)
    loaded = _full_params(model, hooks)
    loss = _step(cfg, model, hooks, opt, sched, step)
    return loaded, loss, _full_params(model, hooks), (cfg, model, hooks, opt, sched)


def _legacy_load_and_step(world: int, files: dict[str, bytes], step: int):
    """Load the single-file format as the trainer resumes (``load_weights``), then take the next step."""
    cfg, model, hooks, opt, sched = _setup(world, seed=99)
    ckpt = LoadedCheckpoint(name="step_00000001", step=1, location="legacy", files=files)
    load_weights(ckpt, model, opt, hooks.layout)  # the trainer's resume path
    sched.load_state_dict(ckpt.train_state()["scheduler"])
    loaded = _full_params(model, hooks)
    loss = _step(cfg, model, hooks, opt, sched, step)
    return {"loaded": loaded, "loss": loss, "after": _full_params(model, hooks)}


def _ep_worker(rank: int, world: int, out_dir, src, dst, legacy=None) -> dict:
    loaded, loss, after, (cfg, model, hooks, opt, sched) = _load_and_step(world, src, step=1)
    legacy_result = _legacy_load_and_step(world, legacy, step=1) if legacy is not None else None
    if dst is not None:  # re-save the state just loaded (before the step above) at this EP size
        cfg, model, hooks, opt, sched = _setup(world, seed=7)
        _load(src, model, hooks, opt, sched)
        _save(dst, model, hooks, opt, sched)
    return {"loaded": loaded, "loss": loss, "after": after, "legacy": legacy_result}


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    cfg, model, hooks, opt, sched = _setup(1, seed=0)
    _step(cfg, model, hooks, opt, sched, step=0)
    saved = _full_params(model, hooks)
    _save(root / "ep1", model, hooks, opt, sched)
    legacy = {MODEL_FILE: encode_model(model),
              STATE_FILE: encode_state({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()})}
    reference = copy.deepcopy((model, opt, sched))
    ref_loss = _step(cfg, *reference[:1], hooks, *reference[1:], step=1)
    ref_after = _full_params(reference[0], hooks)

    ep4 = spawn(_ep_worker, 4, root / "w4", root / "ep1", root / "ep4")
    ep2 = spawn(_ep_worker, 2, root / "w2", root / "ep4", None, legacy)
    single = _load_and_step(1, root / "ep4", step=1)[:3]
    return {"saved": saved, "ref_loss": ref_loss, "ref_after": ref_after, "root": root,
            "ep4": ep4, "ep2": ep2, "single": [dict(zip(("loaded", "loss", "after"), single))],
            "legacy_to_ep2": [r["legacy"] for r in ep2]}


@pytest.mark.parametrize("run", ["ep4", "ep2", "single", "legacy_to_ep2"])
def test_resume_reshards_exactly(chain, run):
    for rank, r in enumerate(chain[run]):
        assert _max_diff(r["loaded"], chain["saved"]) == 0.0, (run, rank)
        assert abs(r["loss"] - chain["ref_loss"]) <= 1e-6 * abs(chain["ref_loss"]), (run, rank, r["loss"])
        assert _max_diff(r["after"], chain["ref_after"]) <= 1e-6, (run, rank)


def test_step_changed_the_weights(chain):
    """The resumed step moved the parameters (so matching them after the step tests the optimizer state)."""
    assert _max_diff(chain["ref_after"], chain["saved"]) > 1e-4


def test_checkpoint_layout(chain):
    """One process wrote the one-process format; EP=4 one shard file per rank, and the marker records the mesh."""
    assert checkpoint_format(Checkpointer(chain["root"] / "ep1").latest()[0].files) == "single"
    ckpt = Checkpointer(chain["root"] / "ep4").latest()[0]
    assert [f for f in sorted(ckpt.deferred) if f.endswith(".distcp")] == [f"__{r}_0.distcp" for r in range(4)]
    assert checkpoint_format(ckpt.files) == "sharded" and b'"ep": 4' in ckpt.files[MARKER]


def test_wrong_model_is_a_checkpoint_error(chain, tmp_path):
    model = MoETransformer(build_config("tiny", overrides={"model": {"vocab_size": 64, "hidden": 32}}).model).double()
    ckpt = Checkpointer(chain["root"] / "ep4").latest()[0]
    with pytest.raises(CheckpointError, match="does not fit"):
        load_weights(ckpt, model, None, ShardLayout(single_process()))
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        load_latest_model(tmp_path, model)
