"""Pipeline stages balanced by the cost model (moetrain.analysis.stages): the split is checked against a brute-force
enumeration of every contiguous partition, the costs against the cost model's whole-model FLOPs, and the trainer,
the dry run and the planner against each other (one split, one memory figure). Also the V-shaped placement of the
zero-bubble schedules and the config checks that refuse what they cannot run."""

from __future__ import annotations

import itertools
import random

import pytest

from moetrain.analysis.flops import step_flops, total_flops
from moetrain.analysis.shape import ModelShape
from moetrain.analysis.stages import balanced_split, split_stages, stage_costs
from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.parallel.pipeline import rank_stages, stage_blocks, stage_rank


def _brute(costs, stages, first, last):
    """(min over partitions of the max stage cost, min sum of squares among partitions within that max)."""
    n, scored = len(costs), []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        stage = [sum(costs[a:b]) + (first if a == 0 else 0) + (last if b == n else 0)
                 for a, b in zip(bounds, bounds[1:])]
        scored.append((max(stage), sum(c * c for c in stage)))
    bottleneck = min(m for m, _ in scored)
    return bottleneck, min(s for m, s in scored if m <= bottleneck * (1 + 1e-12))


def _score(ranges, costs, first, last):
    n = len(costs)
    stage = [sum(costs[r.start:r.stop]) + (first if r.start == 0 else 0) + (last if r.stop == n else 0)
             for r in ranges]
    return max(stage), sum(c * c for c in stage)


def test_balanced_split_matches_brute_force_on_uneven_costs():
    rng = random.Random(7)
    checked = 0
    for n in range(1, 10):
        for stages in range(1, n + 1):
            for _ in range(3):
                costs = [rng.choice([0.5, 1.0, 1.0, 3.0]) * rng.uniform(0.5, 1.5) for _ in range(n)]
                first, last = rng.choice([0.0, 0.7]), rng.choice([0.0, 2.5, 6.0])
                ranges = balanced_split(costs, stages, first, last)
                assert len(ranges) == stages and all(len(r) >= 1 for r in ranges)
                assert [i for r in ranges for i in r] == list(range(n)), "contiguous, in order, covering"
                got, want = _score(ranges, costs, first, last), _brute(costs, stages, first, last)
                assert got[0] == pytest.approx(want[0], rel=1e-12), (costs, stages, first, last, ranges)
                assert got[1] == pytest.approx(want[1], rel=1e-12), (costs, stages, first, last, ranges)
                checked += 1
    assert checked == 3 * sum(range(1, 10))


def test_equal_costs_split_evenly_and_a_heavy_head_moves_blocks_off_the_last_stage():
    assert [len(r) for r in balanced_split([1.0] * 8, 4)] == [2, 2, 2, 2]
    assert [len(r) for r in balanced_split([1.0] * 8, 2, last=2.0)] == [5, 3]  # 5 vs 3 + 2
    with pytest.raises(ValueError, match="stages"):
        balanced_split([1.0] * 3, 4)


def test_block_costs_add_up_to_the_cost_models_total_and_dense_blocks_differ():
    """Independent check of the per-part bookkeeping: blocks + head = analysis.flops' whole-model FLOPs."""
    cfg = build_config("tiny", overrides={"model": {"n_layers": 6, "moe_every": 2, "tie_embeddings": False}}).model
    shape = ModelShape.from_config(cfg)
    flags = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    assert flags == [False, True] * 3
    seq = 64
    for recompute, ckpt in (("none", False), ("full", True)):
        c = stage_costs(shape, flags, seq, recompute=recompute)
        total = total_flops(step_flops(shape, 1, seq, checkpoint=ckpt))
        assert (sum(c.blocks) + c.head + c.embedding) * seq == pytest.approx(total, rel=1e-12)
        assert len({c.blocks[i] for i in (0, 2, 4)}) == 1 and len({c.blocks[i] for i in (1, 3, 5)}) == 1
        assert c.blocks[1] != c.blocks[0]
    # Selective recomputation adds the attention and routed-experts forwards to the blocks, not to the head.
    none, sel = stage_costs(shape, flags, seq), stage_costs(shape, flags, seq, recompute="selective")
    fwd = step_flops(shape, 1, seq)
    extra_dense = (fwd["attn_proj"].forward + fwd["attn_scores"].forward) / shape.n_layers / seq
    assert sel.blocks[0] - none.blocks[0] == pytest.approx(extra_dense, rel=1e-12)
    extra_moe = extra_dense + fwd["experts"].forward / shape.moe_layers / seq
    assert sel.blocks[1] - none.blocks[1] == pytest.approx(extra_moe, rel=1e-12)
    assert sel.head == none.head


def test_first_k_dense_blocks_are_packed_onto_the_first_stage():
    """DeepSeek-style dense first blocks are cheap: the first stage takes more of them than an even split."""
    cfg = build_config("tiny", overrides={"model": {"n_layers": 8, "first_k_dense": 3, "tie_embeddings": False,
                                                    "moe": {"num_experts": 16, "top_k": 4}}}).model
    ranges = stage_blocks(cfg, 2, seq=128)
    c = stage_costs(ModelShape.from_config(cfg), [cfg.is_moe_layer(i) for i in range(8)], 128)
    assert _score(ranges, c.blocks, 0.0, c.head)[0] == pytest.approx(_brute(c.blocks, 2, 0.0, c.head)[0])
    assert len(ranges[0]) > 4, ranges


def test_trainer_dry_run_and_planner_use_one_split():
    from moetrain.analysis.planner import trainer_fields
    from moetrain.analysis.hardware import get_hardware
    from moetrain.analysis.planner import plan
    from moetrain.parallel.dry_run import check, dry_run

    cfg = build_config("qwen3-30b-a3b")
    shape = ModelShape.from_config(cfg.model)
    flags = [cfg.model.is_moe_layer(i) for i in range(cfg.model.n_layers)]
    result = plan(shape, flags, 16, get_hardware("h200"), 4096, 1024, 2)
    pipelined = [c for c in result.candidates if c.fits and c.layout.pp > 1]
    assert pipelined
    for c in pipelined:
        run = build_config("qwen3-30b-a3b", overrides=trainer_fields(c, 4096, "bf16"))
        _, stages = check(run, 16)
        w = c.best.workload
        assert stages == split_stages(shape, flags, c.layout.pp, 4096, w.bta_tiles,
                                      "full" if w.checkpoint else "none")
        assert stages == stage_blocks(run.model, c.layout.pp, 4096, run.parallel.activation_checkpoint)
        d = dry_run(run, 16)
        assert abs(d.rank_bytes / d.planner_bytes - 1) < 0.01, (c.layout.label, d.rank_bytes, d.planner_bytes)
    # The LM head (151,936 x 2,048) outweighs a block several times: the last of 2 stages holds fewer blocks.
    assert [len(r) for r in stage_blocks(cfg.model, 2, 4096)] == [26, 22]


def test_v_placement_and_its_inverse():
    assert [rank_stages(r, 2, 2, "zbv") for r in range(2)] == [[0, 3], [1, 2]]
    assert [rank_stages(r, 3, 2, "dualpipev") for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [rank_stages(r, 2, 2, "interleaved_1f1b") for r in range(2)] == [[0, 2], [1, 3]]
    for schedule in ("zbv", "1f1b", "interleaved_1f1b"):
        per = 1 if schedule == "1f1b" else 2
        for pp in (2, 4):
            held = {s: r for r in range(pp) for s in rank_stages(r, pp, per, schedule)}
            assert sorted(held) == list(range(pp * per))
            assert all(stage_rank(s, pp, schedule) == r for s, r in held.items())


def test_stage_blocks_and_v_schedules_refuse_what_they_cannot_run():
    cfg = build_config("tiny", overrides={"model": {"n_layers": 2}}).model
    with pytest.raises(ConfigError, match=r"parallel.pp: 4 pipeline stages .* model.n_layers=2"):
        stage_blocks(cfg, 4)
    base = {"pp": 2, "pp_stages_per_rank": 2, "reshard_after_forward": False}
    for schedule in ("zbv", "dualpipev"):
        build_config("tiny", overrides={"parallel": {**base, "pp_schedule": schedule}})
        with pytest.raises(ConfigError, match=r"^parallel.reshard_after_forward: .*input- and weight-gradient"):
            build_config("tiny", overrides={"parallel": {**base, "pp_schedule": schedule,
                                                         "reshard_after_forward": True}})
        with pytest.raises(ConfigError, match=r"^parallel.pp_stages_per_rank: .*exactly 2 stages per rank"):
            build_config("tiny", overrides={"parallel": {**base, "pp_schedule": schedule, "pp_stages_per_rank": 3}})
