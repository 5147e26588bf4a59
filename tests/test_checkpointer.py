"""TrainState + Checkpointer: round trips (one process: safetensors + train_state.pt; two gloo ranks: DCP), exact
continuation after a round trip, and checkpoints written by the code before the Checkpointer existed
(tests/data/legacy_checkpoints, see its README) still load and resume.

The reference for every continuation is the uninterrupted run: the same steps without a save and load between.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from _crash_util import losses_by_step
from _parallel_util import spawn
from moetrain.cli import main
from moetrain.config import build_config
from moetrain.errors import CheckpointError
from moetrain.model.transformer import MoETransformer
from moetrain.parallel.engine import ShardedHooks
from moetrain.parallel.fsdp import full_tensor
from moetrain.parallel.layout import Layout, build_layout_mesh, gather_full
from moetrain.train.checkpoint import MANIFEST, MODEL_FILE, STATE_FILE, CheckpointStore, model_tensors
from moetrain.train.checkpointer import Checkpointer, checkpoint_format, load_latest_model
from moetrain.train.schedule import build_scheduler
from moetrain.train.state import STATE_KEYS, TrainState
from moetrain.train.step import train_step
from moetrain.train.trainer import build_optimizer

LEGACY = Path(__file__).parent / "data" / "legacy_checkpoints"
BATCH, SEQ = 4, 8

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(ep: int = 1):
    moe = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden": 16, "backend": "loop", "expert_bias": True,
           "aux_loss_coeff": 0.0, "global_aux_loss_coeff": 0.01}
    return build_config("tiny", overrides={
        "model": {"vocab_size": 64, "hidden": 16, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "moe": moe},
        "data": {"seq_len": SEQ}, "train": {"batch_size": BATCH, "lr": 1e-2, "warmup_steps": 3, "device": "cpu"},
        "parallel": {"ep": ep},
    })


class _Sampler:
    """A data position: the next micro-batch is a function of the counter only."""

    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + self.position))
        self.position += 1
        return b[:, :-1], b[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _state(seed: int, hooks: ShardedHooks | None = None) -> TrainState:
    cfg = _config(hooks.mesh.ep if hooks is not None else 1)
    torch.manual_seed(seed)
    model = MoETransformer(cfg.model).double()
    if hooks is not None:
        hooks.prepare_model(model)
    opt = build_optimizer(model, cfg)
    return TrainState(model, opt, build_scheduler(opt, cfg.train), _Sampler(), config=cfg.to_dict())


def _train(state: TrainState, steps: int, hooks: ShardedHooks | None = None) -> list[float]:
    cfg = _config(hooks.mesh.ep if hooks is not None else 1)
    kwargs, next_batch = {}, state.sampler.next_batch
    if hooks is not None:
        kwargs, next_batch = hooks.step_kwargs(), hooks.local_batch(next_batch)
    losses = []
    for _ in range(steps):
        losses.append(float(train_step(state.model, next_batch, state.optimizer, state.scheduler, cfg.train,
                                       torch.device("cpu"), **kwargs).lm_loss))
        state.step += 1
    return losses


def _full(model, hooks: ShardedHooks | None = None) -> dict[str, torch.Tensor]:
    """Parameters and buffers (expert biases included) as full tensors."""
    out = {}
    for name, t in model.state_dict().items():
        plan = hooks.plan if hooks is not None else {}
        t = full_tensor(t).clone()
        out[name] = gather_full(t, plan[name], hooks.mesh) if name in plan else t
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- one process --------------------------------------------------------------------------------------------------
def test_single_round_trip_restores_everything_and_continues_exactly(tmp_path):
    state = _state(seed=0)
    _train(state, 2)
    state.nonfinite_total, state.nonfinite_in_a_row, state.initial_val_loss = 3, 1, 4.5
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    ckpt_dir = tmp_path / "ckpt"
    where = Checkpointer(ckpt_dir).save(state, {"config.json": b"{}"})
    assert where == str(ckpt_dir / "step_00000002")
    rng_after_save = (random.random(), float(np.random.rand()), float(torch.rand(())))
    reference = copy.deepcopy(state)
    ref_losses = _train(reference, 2)

    fresh = _state(seed=99)
    assert not _same(_full(fresh.model), _full(state.model))
    checkpointer = Checkpointer(ckpt_dir)
    ckpt, skipped = checkpointer.latest()
    assert skipped == [] and checkpoint_format(ckpt.files) == "single"
    assert sorted(ckpt.files) == sorted([MODEL_FILE, STATE_FILE, "config.json"])
    saved = checkpointer.load(ckpt, fresh)
    assert set(saved) == set(STATE_KEYS)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == rng_after_save
    assert _same(_full(fresh.model), _full(state.model))  # expert biases (buffers) included
    assert any("bias" in k for k in _full(fresh.model))
    assert (fresh.step, fresh.sampler.position, fresh.initial_val_loss) == (2, 2, 4.5)
    assert (fresh.nonfinite_total, fresh.nonfinite_in_a_row) == (3, 1)
    assert fresh.scheduler.state_dict() == state.scheduler.state_dict()
    assert _train(fresh, 2) == ref_losses  # AdamW moments, schedule and data position were all restored
    assert _same(_full(fresh.model), _full(reference.model))


def test_load_into_another_model_shape_names_the_file(tmp_path):
    state = _state(seed=0)
    Checkpointer(tmp_path).save(state)
    other = build_config("tiny", overrides={"model": {"vocab_size": 64, "hidden": 32}})
    torch.manual_seed(0)
    model = MoETransformer(other.model)
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE}: tensor .* has shape"):
        load_latest_model(tmp_path, model)


# -- two gloo ranks (EP=2): DCP through the same store and manifest -------------------------------------------------
def _dcp_worker(rank: int, world: int, out_dir: Path, ckpt_dir: Path) -> dict:
    cfg = _config(world)
    hooks = ShardedHooks(build_layout_mesh(Layout.from_config(cfg.parallel, world), 60, torch.device("cpu")),
                         cfg.parallel)
    state = _state(seed=0, hooks=hooks)
    _train(state, 2, hooks)
    saved_full = _full(state.model, hooks)
    where = Checkpointer(ckpt_dir, hooks.layout).save(state, {"config.json": b"{}"})
    after = _train(state, 1, hooks)
    # reload at EP=2 into a model initialised differently, then the same next step
    fresh = _state(seed=99, hooks=hooks)
    ckpt, _ = Checkpointer(ckpt_dir, hooks.layout).latest()
    Checkpointer(ckpt_dir, hooks.layout).load(ckpt, fresh)
    return {"where": where, "saved": saved_full, "loaded": _full(fresh.model, hooks),
            "step": fresh.step, "position": fresh.sampler.position, "next": _train(fresh, 1, hooks), "after": after}


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dcp")
    ranks = spawn(_dcp_worker, 2, root / "w", root / "ckpt")
    return {"ranks": ranks, "dir": root / "ckpt"}


def test_dcp_round_trip_goes_through_the_same_store_and_manifest(dcp_run):
    r0, r1 = dcp_run["ranks"]
    assert r0["where"] == r1["where"] == str(dcp_run["dir"] / "step_00000002")
    store = CheckpointStore(dcp_run["dir"])
    ckpt = store.read_verified("step_00000002")  # size + SHA-256 of every file against the manifest
    assert checkpoint_format(ckpt.files) == "sharded"
    assert sorted(ckpt.files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "config.json", "moetrain.json",
                                  STATE_FILE]
    manifest = json.loads((dcp_run["dir"] / "step_00000002" / MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(ckpt.files)
    assert "optimizer" not in ckpt.train_state()  # it is in the shards
    for r in (r0, r1):
        assert _same(r["loaded"], r["saved"]) and (r["step"], r["position"]) == (2, 2)
        assert r["next"] == r0["after"]  # the loaded state continues as the saved one did


def test_dcp_checkpoint_loads_in_one_process_and_continues_like_the_job(dcp_run):
    """EP=2 -> one process: DCP reshards the experts; the next step's loss matches the EP=2 job's."""
    fresh = _state(seed=5)
    checkpointer = Checkpointer(dcp_run["dir"])
    ckpt, _ = checkpointer.latest()
    checkpointer.load(ckpt, fresh)
    assert _same(_full(fresh.model), dcp_run["ranks"][0]["saved"])
    assert abs(_train(fresh, 1)[0] - dcp_run["ranks"][0]["after"][0]) <= 1e-12


# -- checkpoints written by the previous code (format 1, commit b137dba) -----------------------------------------------
def _legacy_run(tmp_path: Path, name: str) -> Path:
    run = tmp_path / name
    shutil.copytree(LEGACY / name, run)
    return run


def _legacy_reference(name: str) -> dict:
    """The step-3 checkpoint's content read without moetrain: safetensors + torch.load for the single format,
    PyTorch's own DCP converter (``dcp_to_torch_save``) for the sharded one. ``model``: FQN -> tensor; ``optim``:
    FQN -> AdamW state."""
    ckpt = LEGACY / name / "checkpoints" / "step_00000003"
    if name == "single":
        state = torch.load(ckpt / STATE_FILE, weights_only=True)
        model = load_file(ckpt / MODEL_FILE)
        return {"model": model, "optim": state["optimizer"], "state": state}
    out = Path(tempfile.mkdtemp()) / "converted.pt"
    dcp_to_torch_save(ckpt, out)
    converted = torch.load(out, weights_only=False)
    shutil.rmtree(out.parent)
    return {"model": converted["model"], "optim": converted["optim"],
            "state": torch.load(ckpt / STATE_FILE, weights_only=True)}


@pytest.mark.parametrize("name", ["single", "ep2"])
def test_legacy_checkpoint_loads_for_eval(tmp_path, name):
    """``load_run`` (eval / generate) reads both formats of the old code into one process, bit for bit."""
    from moetrain.commands.run_dir import load_run

    run = load_run(str(_legacy_run(tmp_path, name)))
    assert run.checkpoint.step == 3
    want = _legacy_reference(name)["model"]
    got = model_tensors(run.model) if name == "single" else run.model.state_dict()  # DCP keeps tied names twice
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("name", ["single", "ep2"])
def test_legacy_checkpoint_loads_into_a_train_state(name):
    """Model, AdamW moments, step, schedule and data position of an old checkpoint, as the old code wrote them."""
    from moetrain.config import Config

    cfg = Config.from_dict(json.loads((LEGACY / name / "config.json").read_text()))
    torch.manual_seed(1)
    model = MoETransformer(cfg.model)
    opt = build_optimizer(model, cfg)
    state = TrainState(model, opt, build_scheduler(opt, cfg.train))
    checkpointer = Checkpointer(LEGACY / name / "checkpoints")
    ckpt, skipped = checkpointer.latest()
    assert skipped == []
    saved = checkpointer.load(ckpt, state)
    ref = _legacy_reference(name)
    assert state.step == 3 and saved["sampler"] == ref["state"]["sampler"]
    assert state.scheduler.state_dict() == ref["state"]["scheduler"]
    got = model.state_dict()
    assert all(torch.equal(got[k], ref["model"][k]) for k in ref["model"])
    name_of = {p: n for n, p in model.named_parameters()}
    order = [name_of[p] for g in opt.param_groups for p in g["params"]]  # what PyTorch's indices count
    by_param = {n: opt.state[p] for n, p in model.named_parameters()}
    for i, n in enumerate(order):
        want = ref["optim"]["state"][i] if name == "single" else ref["optim"][n]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(by_param[n][key], want[key]), (n, key)


@pytest.mark.parametrize("name", ["single", "ep2"])
def test_legacy_checkpoint_resumes_like_the_old_codes_uninterrupted_run(tmp_path, name):
    """The old code trained 5 steps uninterrupted in one process (reference/) and, separately, stopped at step 3
    (single/ in one process, ep2/ on two gloo ranks at EP=2). Resuming single/ with this code gives the
    reference's losses of steps 4 and 5 and its final weights. ep2/ took another trajectory from step 2 on (its
    aux-loss-free bias updates flipped on a ~1e-6 difference in the counts' inputs), so there only the losses are
    compared, loosely: it resumes in one process and trains on."""
    run = _legacy_run(tmp_path, name)
    corpus = tmp_path / "corpus.txt"
    shutil.copy(LEGACY / "corpus.txt", corpus)
    # The run directory's config names the corpus where it was made; point it here (the checkpoint is untouched).
    config = json.loads((run / "config.json").read_text())
    config["data"].update(path=str(corpus), cache_dir=str(tmp_path / "cache"))
    (run / "config.json").write_text(json.dumps(config))
    args = ["train", "--out", str(run), "--no-progress", "--resume", "parallel.ep=1"]
    assert main(args) == 0
    ref = losses_by_step(LEGACY / "reference")
    got = losses_by_step(run)
    tol = 1e-6 if name == "single" else 1e-4
    for step in (4, 5):
        assert abs(got[step] - ref[step]) <= tol * abs(ref[step]), (step, got[step], ref[step])
    final = CheckpointStore(run / "checkpoints").latest_valid()[0]
    assert final.step == 5
    if name != "single":
        return
    want = load_file(LEGACY / "reference" / "model_step5.safetensors")
    got_w = final.model_tensors()
    assert sorted(got_w) == sorted(want)
    worst = max(float((got_w[k].double() - want[k].double()).abs().max()) for k in want)
    assert worst <= 1e-6, worst


def test_resumed_adamw_keeps_this_runs_implementation_and_the_saved_hyperparameters():
    """A checkpoint written by AdamW's per-tensor loop (``fused=None``, as the engine's runs were before they used
    the fused kernel on DTensor shards) resumes on the fused kernel this run chose, with the saved learning rate and
    moments: the next step equals the loop's to fp32 rounding."""
    from moetrain.parallel.dcp import saved_group

    torch.manual_seed(0)
    weights = [torch.randn(8, 4), torch.randn(4)]
    grads = [torch.randn_like(w) for w in weights]

    def adamw(fused: bool | None) -> torch.optim.AdamW:
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        return torch.optim.AdamW(params, lr=0.01 if fused else 0.02, weight_decay=0.1, fused=fused)

    def step(opt: torch.optim.AdamW) -> None:
        for p, g in zip(opt.param_groups[0]["params"], grads):
            p.grad = g.clone()
        opt.step()

    saved = adamw(None)
    step(saved)
    state = saved.state_dict()
    resumed = adamw(True)
    for p, q in zip(resumed.param_groups[0]["params"], saved.param_groups[0]["params"]):
        p.data.copy_(q.data)
    resumed.load_state_dict({**state, "param_groups": [{**saved_group(g, mine), "params": g["params"]}
                                                       for g, mine in zip(state["param_groups"],
                                                                          resumed.param_groups)]})
    group = resumed.param_groups[0]
    assert group["fused"] is True and group["lr"] == 0.02
    step(saved)
    step(resumed)
    for p, q in zip(resumed.param_groups[0]["params"], saved.param_groups[0]["params"]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
