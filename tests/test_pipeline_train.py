"""Pipeline parallelism (``parallel.pp``, torch.distributed.pipelining) on gloo: gradients of one step and the
losses and parameters of 3 optimizer steps equal one process on the same global batch.

The MoE aux losses are made large (coefficients 0.5-1) so that a stage's aux loss lost, double-counted or scaled
differently from one process would show in every router's and expert's gradient (AdamW's per-parameter
normalisation would hide a pure rescaling of all gradients, not a wrong mix of LM and aux terms; the gradients are
compared before any optimizer step as well). Micro-batches come from gradient accumulation (M = 2 or 4). The
schedules: 1F1B, GPipe, Interleaved 1F1B (looped placement) and the V-shaped ZBV and DualPipeV (rank r holds
stages r and 2P - 1 - r). Then the routing monitor: rank 0 reports every stage's MoE layers as one process does.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from _parallel_util import spawn
from moetrain.model.transformer import MoETransformer
from moetrain.parallel.engine import ShardedHooks
from moetrain.parallel.fsdp import full_tensor, local_bytes
from moetrain.parallel.layout import Layout, build_layout_mesh, gather_full
from moetrain.parallel.meta_init import build_meta, init_parameters
from moetrain.parallel.pipeline_runner import PipelineRunner
from moetrain.train.schedule import build_scheduler
from moetrain.train.step import accumulate_gradients, train_step
from moetrain.train.trainer import build_optimizer, evaluate
from test_fsdp_train import batches, sampler, small_config

STEPS = 3
LOSSES = {"aux_loss_coeff": 0.5, "global_aux_loss_coeff": 1.0, "seq_aux_loss_coeff": 0.5, "z_loss_coeff": 0.5}


def _config(parallel: dict, grad_accum: int):
    cfg = small_config(parallel, grad_accum=grad_accum)
    from moetrain.config import build_config

    data = cfg.to_dict()
    data["model"]["moe"]["losses"].update(LOSSES)
    if parallel.get("ep", 1) > 1:
        # The Switch loss of a rank's rows is not linear in the batch: with data parallelism (the EP ranks read
        # different rows) its mean over ranks differs from one process's, as documented in train/step.py.
        data["model"]["moe"]["losses"]["aux_loss_coeff"] = 0.0
    return build_config(None, overrides=data)


def _gathered(p: torch.Tensor, name: str, plan, mesh) -> torch.Tensor:
    full = full_tensor(p)
    return gather_full(full, plan[name], mesh.ep_mesh) if name in plan else full


def _worker(rank: int, world: int, out_dir, parallel: dict, grad_accum: int, static: bool = True) -> dict:
    """:func:`_run`, counting FSDP2's warnings that a sharded module returned a view (see
    test_stage_output_is_no_view_and_carries_the_moe_loss)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = _run(parallel, grad_accum, static, world)
    out["view_warnings"] = sum("returned a view tensor" in str(w.message) for w in seen)
    return out


def _run(parallel: dict, grad_accum: int, static: bool, world: int) -> dict:
    cfg = _config(parallel, grad_accum)
    mesh = build_layout_mesh(Layout.from_config(cfg.parallel, world), 60, torch.device("cpu"))
    ref = MoETransformer(cfg.model)
    init_parameters(ref, cfg.model, cfg.train.seed)
    hooks = ShardedHooks(mesh, cfg.parallel, cfg.train.dtype, cfg.train.seed)
    rows = cfg.train.batch_size // mesh.layout.data_parallel
    runner = PipelineRunner(build_meta(cfg.model), mesh, cfg.parallel, grad_accum, seed=cfg.train.seed,
                            stats=hooks.stats, micro_shape=(rows, cfg.data.seq_len) if static else None)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in runner.local.named_parameters()]
    out = {"names": names}

    # Gradients of one step (no optimizer step), before anything could compensate.
    data = batches(cfg, grad_accum * (STEPS + 1))
    pick = sampler(data[:grad_accum])
    mine = hooks.local_batch(pick)
    acc = runner.forward_backward([mine() for _ in range(grad_accum)])
    glob = sampler(data[:grad_accum])
    ref_acc = accumulate_gradients(ref, [glob() for _ in range(grad_accum)], "fp32", torch.device("cpu"))
    worst, scale = 0.0, 0.0
    for name, p in runner.local.named_parameters():
        g = _gathered(p.grad, name, runner.plan, mesh)
        worst = max(worst, (g - ref_params[name].grad).abs().max().item())
        scale = max(scale, ref_params[name].grad.abs().max().item())
    out["grad"], out["grad_scale"] = worst, scale
    lm = hooks.reduce_mean(acc.lm_loss.reshape(1))[0]
    out["first_lm"] = abs(float(lm) - float(ref_acc.lm_loss))
    moe = hooks.reduce_mean(acc.moe_losses["moe_loss"].reshape(1))[0]  # the first step's shape inference excluded
    out["first_moe"] = abs(float(moe) - float(ref_acc.moe_losses["moe_loss"])) if "ep" not in parallel else 0.0
    runner.local.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)

    # Three optimizer steps.
    runs = []
    for kind in ("pipeline", "ref"):
        m = runner.local if kind == "pipeline" else ref
        opt = build_optimizer(m, cfg)
        sched = build_scheduler(opt, cfg.train)
        rest = sampler(data[grad_accum:])
        if kind == "pipeline":
            pipeline_opt = opt
            steps = [runner.train_step(hooks.local_batch(rest), opt, sched, cfg.train, hooks.reduce_mean,
                                       hooks.count_reducer) for _ in range(STEPS)]
        else:
            steps = [train_step(ref, rest, opt, sched, cfg.train, torch.device("cpu")) for _ in range(STEPS)]
        runs.append(steps)
    for key in ("lm_loss", "grad_norm"):
        out[key] = max(abs(float(getattr(a, key)) - float(getattr(b, key))) for a, b in zip(*runs))
    for key in ("global_aux_loss", "aux_loss", "seq_aux_loss", "z_loss", "moe_loss"):
        out[key] = max(abs(float(a.moe_losses[key]) - float(b.moe_losses[key])) for a, b in zip(*runs))
    out["ref_moe_loss"] = float(runs[1][0].moe_losses["moe_loss"])
    worst = 0.0
    for name, p in runner.local.named_parameters():
        worst = max(worst, (_gathered(p, name, runner.plan, mesh) - ref_params[name].detach()).abs().max().item())
    out["params"] = worst
    # Validation through the stages (every rank takes the whole batches) equals one process's.
    val = [sampler(data[:1])()]
    out["val"] = abs(runner.evaluate(val) - evaluate(ref, val, torch.device("cpu"), "fp32"))
    runner.forward_backward([hooks.local_batch(sampler(data[:grad_accum]))() for _ in range(grad_accum)])
    out["held"] = local_bytes(runner.local, pipeline_opt)
    return out


V_SHAPED = {"reshard_after_forward": False}  # what the split-backward schedules need (parallel/config.py)
CASES = {
    "pp2_1f1b_accum2": (2, {"pp": 2}, 2),
    "pp2_1f1b_accum2_inferred_shapes": (2, {"pp": 2}, 2, False),
    "pp2_gpipe_accum2": (2, {"pp": 2, "pp_schedule": "gpipe"}, 2),
    "pp2_interleaved_accum4": (2, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2}, 4),
    "pp2_ep2_1f1b_accum2": (4, {"pp": 2, "ep": 2}, 2),
    "pp2_zbv_accum4": (2, {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2, **V_SHAPED}, 4),
    "pp2_dualpipev_accum4": (2, {"pp": 2, "pp_schedule": "dualpipev", "pp_stages_per_rank": 2, **V_SHAPED}, 4),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return {name: spawn(_worker, case[0], tmp_path_factory.mktemp(name), *case[1:], timeout_s=300)
            for name, case in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_single_process(results, name):
    covered = set()
    for rank, r in enumerate(results[name]):
        covered.update(r["names"])
        r = {k: v for k, v in r.items() if k not in ("names", "held")}
        print(name, rank, r)
        assert r["view_warnings"] == 0, "a pipeline stage returned a view"
        assert r["grad"] <= 1e-5 * max(1.0, r["grad_scale"]), (name, rank, r)
        assert r["first_lm"] <= 1e-5 and r["first_moe"] <= 1e-5, (name, rank, r)
        assert r["ref_moe_loss"] > 0.5, "the aux losses must weigh in the test"
        keys = ["lm_loss", "grad_norm", "global_aux_loss", "seq_aux_loss", "z_loss", "moe_loss"]
        if CASES[name][1].get("ep", 1) == 1:  # the reported Switch loss is per rank's rows (see _config)
            keys.append("aux_loss")
        for key in keys:
            assert r[key] <= 1e-4, (name, rank, key, r[key])
        assert r["params"] <= 1e-5, (name, rank, r)
        assert r["val"] <= 1e-5, (name, rank, r)
    ref = MoETransformer(small_config({}).model)
    assert covered == {n for n, _ in ref.named_parameters()}, "every stage covered"


@pytest.mark.parametrize("name", ["pp2_1f1b_accum2", "pp2_ep2_1f1b_accum2"])
def test_held_bytes_match_the_planner(results, name):
    """The busiest rank's live parameters + gradients + AdamW moments within 10% of the planner's figure
    (moetrain.analysis.params.sharded_params for the trainer's stages)."""
    from moetrain.analysis.params import count_params, placements, sharded_params
    from moetrain.analysis.shape import ModelShape
    from moetrain.parallel.pipeline import stage_blocks

    world, parallel, accum = CASES[name][:3]
    cfg = _config(parallel, accum)
    shape = ModelShape.from_config(cfg.model)
    stages = placements(stage_blocks(cfg.model, parallel["pp"], cfg.data.seq_len))
    predicted = 16 * sharded_params(count_params(shape), shape.n_layers, parallel.get("ep", 1), parallel["pp"], 1,
                                    stages)
    held = max(r["held"]["total"] for r in results[name])
    print(name, "busiest rank", held, "planner", predicted)
    assert abs(held / predicted - 1) <= 0.10, (held, predicted)


def test_stage_output_is_no_view_and_carries_the_moe_loss():
    """FSDP2 warns when a sharded module returns a view (an in-place op on it would drop the module's pre-backward
    hook and skip its all-gather): no stage's output is a view, and its backward gives the inputs and every
    parameter the gradients of ``(output * g).sum() + moe_loss``, the stage's share of one process's loss."""
    from moetrain.parallel.pipeline import StageModule

    cfg = _config({"pp": 2}, 2)
    model = MoETransformer(cfg.model)
    init_parameters(model, cfg.model, cfg.train.seed)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=gen)
    hidden = torch.randn(2, 8, cfg.model.hidden, generator=gen)
    for first, last, blocks, x in ((True, False, range(0, 2), ids), (False, True, range(2, 4), hidden)):
        stage = StageModule(model, blocks, first, last)
        grads = []
        for attached in (True, False):
            stage.zero_grad(set_to_none=True)
            inp = x if first else x.clone().requires_grad_(True)
            if attached:
                out = stage(inp)
                assert out._base is None, "the stage returned a view"
                g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
                out.backward(g)
            else:  # the same loss written out: no _AttachLoss
                h, records = stage.trunk(inp)
                out = stage.head(h) if last else h
                moe_loss = stage.moe_terms(records)["moe_loss"]
                ((out * g).sum() + moe_loss).backward()
            grads.append([t.grad.clone() for t in [*stage.parameters(), inp] if t.grad is not None])
        assert stage.records and len(grads[0]) == len(grads[1]) == sum(1 for _ in stage.parameters()) + (not first)
        for a, b in zip(*grads):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
        assert float(moe_loss.detach()) > 0.1, "the MoE loss must weigh in the gradients"


def test_stages_chained_in_one_process_are_the_models_forward():
    """Stages run the model's own forward steps: two stages chained by hand (tied embeddings, the last stage's own
    copy as LM head) give the model's logits and MoE records, with dropout in training (same RNG draws) and
    without it after the stages' ``eval()``."""
    from moetrain.parallel.pipeline import StageModule

    data = _config({"pp": 2}, 2).to_dict()
    data["model"].update(dropout=0.2, tie_embeddings=True)
    from moetrain.config import build_config

    cfg = build_config(None, overrides=data)
    model = MoETransformer(cfg.model)
    init_parameters(model, cfg.model, cfg.train.seed)
    stages = [StageModule(model, range(0, 2), True, False), StageModule(model, range(2, 4), False, True)]
    ids = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    for train in (True, False):
        for m in (model, *stages):
            m.train(train)
        torch.manual_seed(1)
        want = model(ids)
        torch.manual_seed(1)
        h, first = stages[0].trunk(ids)
        h, last = stages[1].trunk(h)
        logits = stages[1].head(h)
        assert want.logits is not None and torch.equal(logits, want.logits), train
        got = [r.tokens_per_expert for r in first + last]
        assert len(got) == len(want.moe) and all(torch.equal(a, r.tokens_per_expert) for a, r in zip(got, want.moe))
    model.train()
    for m in stages:
        m.eval()  # the stages' mode, not the whole model's, decides the embedding's dropout
    assert torch.equal(stages[0].trunk(ids)[0], stages[0].trunk(ids)[0])


def test_monitor_names_a_stage_layers_by_their_block(tmp_path):
    """The routing monitor of a pipeline rank observes its stages' MoE layers under their global block index."""
    from moetrain.parallel.pipeline import StageModule
    from moetrain.parallel.pipeline_runner import LocalModel
    from moetrain.train.monitor import RoutingMonitor
    from moetrain.train.monitor_config import MonitorConfig

    model = MoETransformer(small_config({}).model)
    local = LocalModel([StageModule(model, range(2, 4), first=False, last=True)])
    monitor = RoutingMonitor(local, MonitorConfig(), tmp_path)
    assert monitor.stats.layer_ids == [2, 3]
    assert [layer for _, layer in monitor.layers] == [model.blocks[2].ffn, model.blocks[3].ffn]
    monitor.close()


def test_pp2_dp_shard2_ep2_on_8_ranks_matches_single_process(tmp_path):
    """The issue's largest layout: 8 gloo ranks (~6 s on 2 idle cores: tiny shapes, one thread per rank); the
    busiest rank's live parameters + gradients + AdamW moments within 10% of the planner's figure."""
    from moetrain.analysis.params import count_params, sharded_params
    from moetrain.analysis.shape import ModelShape

    parallel = {"pp": 2, "dp_shard": 2, "ep": 2}
    results = spawn(_worker, 8, tmp_path, parallel, 2, timeout_s=600)
    for rank, r in enumerate(results):
        r = {k: v for k, v in r.items() if k not in ("names", "held")}
        print(rank, r)
        assert r["view_warnings"] == 0, "a pipeline stage returned a view"
        assert r["grad"] <= 1e-5 * max(1.0, r["grad_scale"]), (rank, r)
        for key in ("lm_loss", "grad_norm", "global_aux_loss", "seq_aux_loss", "z_loss", "moe_loss", "val"):
            assert r[key] <= 1e-4, (rank, key, r[key])
        assert r["params"] <= 1e-5, (rank, r)
    shape = ModelShape.from_config(_config(parallel, 2).model)
    predicted = 16 * sharded_params(count_params(shape), shape.n_layers, ep=2, pp=2, dp_shard=2)
    held = max(r["held"]["total"] for r in results)
    print("busiest rank", held, "planner", predicted)
    assert abs(held / predicted - 1) <= 0.10, (held, predicted)


# -- routing statistics of every stage reach rank 0's monitor ---------------------------------------------------

MONITORED = {
    # MoE blocks 1-3; stage 0 holds blocks 0-1 (dense 0, MoE 1), stage 1 the MoE blocks 2-3; expert biases on.
    "first_block_dense": {"first_k_dense": 1, "moe": {"router": {"expert_bias": True}}},
    # MoE blocks 2-3 only: the cost model puts the two cheap dense blocks on stage 0, so rank 0 holds no MoE layer
    # and learns the record layout from the other stage's rows.
    "no_moe_on_rank0": {"first_k_dense": 2},
}


def _monitor_config(model: dict):
    cfg = _config({"pp": 2}, 2)
    from moetrain.config import build_config

    data = cfg.to_dict()
    for key, value in model.items():
        if isinstance(value, dict):
            for k, v in value.items():
                data["model"][key].setdefault(k, {}).update(v) if isinstance(v, dict) else None
        else:
            data["model"][key] = value
    # Thresholds every layer crosses, so that each layer's alarm shows which layers the alarms see.
    data["monitor"] = {"collapse_fraction": 0.05, "tb_histograms": False, "tb_heatmap": False}
    data["train"]["log_every"] = 2
    return build_config(None, overrides=data)


def _routing(cfg, monitor, step_fn, steps: int) -> list[dict]:
    out = []
    for step in range(1, steps + 1):
        result = step_fn()
        monitor.end_step(step, result.lm_loss)
        if step % cfg.train.log_every == 0 or step == steps:
            out.append(monitor.flush(step))
    monitor.close()
    return out


def _monitor_worker(rank: int, world: int, out_dir, model: dict) -> dict:
    """The trainer's path: ShardedHooks' stage exchange and monitor config, a RoutingMonitor per rank; then on rank 0
    the same steps in one process with its own monitor."""
    from moetrain.train.monitor import RoutingMonitor

    cfg = _monitor_config(model)
    cpu = torch.device("cpu")
    mesh = build_layout_mesh(Layout.from_config(cfg.parallel, world), 60, cpu)
    hooks = ShardedHooks(mesh, cfg.parallel, "fp32", cfg.train.seed, grad_accum=cfg.train.grad_accum,
                         micro_shape=(cfg.train.batch_size, cfg.data.seq_len))
    local = hooks.prepare_model(hooks.build_model(cfg.model, cpu))
    (out_dir / f"rank{rank}").mkdir()
    monitor = RoutingMonitor(local, hooks.monitor_config(cfg.monitor), out_dir / f"rank{rank}", lambda _: None,
                             stages=hooks.stage_routing())
    opt = build_optimizer(local, cfg)
    sched = build_scheduler(opt, cfg.train)
    data = batches(cfg, cfg.train.grad_accum * STEPS)
    nxt = hooks.local_batch(sampler(data))
    out = {"records": _routing(cfg, monitor, lambda: hooks.train_step(local, nxt, opt, sched, cfg.train, cpu), STEPS),
           "local": [i for i, _ in monitor.layers], "ids": monitor.stats.layer_ids,
           "alerts": (out_dir / f"rank{rank}" / "alerts.jsonl").read_text() if rank == 0 else ""}
    if rank == 0:
        ref = MoETransformer(cfg.model)
        init_parameters(ref, cfg.model, cfg.train.seed)
        (out_dir / "one").mkdir()
        ref_monitor = RoutingMonitor(ref, cfg.monitor, out_dir / "one", lambda _: None)
        opt = build_optimizer(ref, cfg)
        sched = build_scheduler(opt, cfg.train)
        glob = sampler(data)
        out["ref"] = _routing(cfg, ref_monitor, lambda: train_step(ref, glob, opt, sched, cfg.train, cpu), STEPS)
        out["ref_alerts"] = (out_dir / "one" / "alerts.jsonl").read_text()
    return out


@pytest.mark.parametrize("name", list(MONITORED))
def test_every_stages_routing_statistics_reach_rank0(tmp_path, name):
    """pp=2 (2 gloo ranks, 3 steps, logging every 2): rank 0's metrics fields cover every MoE layer under its global
    block index, with the one-process run's exact token counts (and its statistics, biases and alarms); the
    other rank reports nothing itself."""
    import json

    first, second = spawn(_monitor_worker, 2, tmp_path, MONITORED[name], timeout_s=300)
    cfg = _monitor_config(MONITORED[name])
    moe = cfg.model.moe_layer_indices
    assert first["ids"] == moe and set(first["local"]) < set(moe), "rank 0 holds some MoE layers at most"
    assert sorted(first["local"] + second["local"]) == moe, "each MoE layer observed by one stage"
    if name == "no_moe_on_rank0":
        assert first["local"] == []
    assert all(r == {} for r in second["records"]), "only rank 0 reports"
    assert len(first["records"]) == len(first["ref"]) == 2
    for got, want in zip(first["records"], first["ref"]):
        assert set(got) == set(want), set(got) ^ set(want)
        assert {k.split("/")[1] for k in got if k.startswith("moe/layer")} == {f"layer{i}" for i in moe}
        for key, value in want.items():
            if key.endswith(("/tokens", "/dead", "/n_dead")) or isinstance(value, int):
                assert got[key] == value, (key, got[key], value)  # exact counts
            elif isinstance(value, list):
                assert got[key] == pytest.approx(value, abs=1e-6), key
            elif value is not None:
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, got[key], value)
            else:
                assert got[key] is None, key
        assert sum(sum(got[f"moe/layer{i}/tokens"]) for i in moe) > 0
    if name == "first_block_dense":
        assert all(f"moe/layer{i}/bias" in first["records"][-1] for i in moe)
    alarms = [(a["kind"], a["layer"], a["step"]) for a in map(json.loads, first["alerts"].splitlines())]
    assert alarms == [(a["kind"], a["layer"], a["step"]) for a in map(json.loads, first["ref_alerts"].splitlines())]
    assert {layer for kind, layer, _ in alarms if kind == "collapse"} == set(moe)
