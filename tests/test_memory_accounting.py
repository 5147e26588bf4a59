"""Per-rank memory: the layout model (``--dry-run``'s lines, moetrain.parallel.memory) against the counts it must
agree with, the measured figures in metrics.jsonl, and the refusal of a model that does not fit a per-process cap
(naming the layout to try)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetrain.cli import main
from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.parallel.dry_run import dry_run
from moetrain.parallel.memory import rank_memory
from moetrain.runtime.preflight import check_fits

PIPE = {"model": {"tie_embeddings": False}}


@pytest.mark.parametrize("parallel, world", [({}, 1), ({"dp_shard": 2}, 2), ({"dp_shard": 4}, 4), ({"ep": 2}, 2),
                                             ({"pp": 2}, 2), ({"dp_shard": 2, "reshard_after_forward": False}, 2)])
def test_state_is_the_dry_runs_and_its_parts_are_4_4_8(parallel, world):
    cfg = build_config("tiny", overrides={**PIPE, "parallel": parallel, "train": {"grad_accum": 2}})
    ranks = rank_memory(cfg, world)
    assert len(ranks) == cfg.parallel.pp
    assert max(r.state for r in ranks) == dry_run(cfg, world).rank_bytes
    for r in ranks:
        assert r.grads == r.params and r.optimizer == 2 * r.params and r.activations > 0
        assert (r.gathered > 0) == (world > 1 and cfg.parallel.pp == 1)  # one engine: every layout on FSDP2


def test_sharding_divides_the_state_and_zero2_gathers_more():
    one = rank_memory(build_config("tiny", overrides=PIPE), 1)[0]
    cfg = build_config("tiny", overrides={**PIPE, "parallel": {"dp_shard": 4}})
    zero3 = rank_memory(cfg, 4)[0]
    zero2 = rank_memory(build_config("tiny", overrides={**PIPE, "parallel": {"dp_shard": 4,
                                                                             "reshard_after_forward": False}}), 4)[0]
    assert one.state / 4 <= zero3.state <= one.state / 4 * 1.05  # padding of dim 0 to 4 rows
    assert zero2.state == zero3.state and zero2.gathered > zero3.gathered
    assert zero3.activations == pytest.approx(one.activations / 4, rel=0.35)  # a quarter of the rows each


def test_dry_run_prints_each_ranks_parts(capsys):
    assert main(["train", "--preset", "tiny", "--dry-run", "--world-size", "2", "parallel.pp=2",
                 "model.tie_embeddings=false"]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"rank {rank} (pipeline rank {rank})"))
        for part in ("parameters", "gradients", "AdamW state", "gathered", "activations", "peak"):
            assert part in line, line


def test_a_model_over_the_free_memory_names_the_layout_that_fits():
    cfg = build_config("tiny", overrides={"model": {"hidden": 256, "moe": {"experts": {"ffn_hidden": 1024}}},
                                          "train": {"batch_size": 4}})
    need = rank_memory(cfg, 1)[0]
    assert need.state > need.activations  # the state is what does not fit
    with pytest.raises(ConfigError, match=r"out of memory\); try parallel.dp_shard=(\d+) on \1 processes"):
        check_fits(cfg, free=need.state * 0.6)
    check_fits(cfg, free=1e12)


def test_a_process_limit_is_the_free_memory():
    code = ("import resource; from moetrain.runtime.preflight import available_memory, process_limit; "
            "resource.setrlimit(resource.RLIMIT_DATA, (2 * 10**9, resource.RLIM_INFINITY)); "
            "name, free = process_limit(); assert name == 'RLIMIT_DATA' and 1e9 < free < 2e9, free; "
            "assert available_memory() <= free")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_metrics_record_each_ranks_measured_memory(tmp_path, code_corpus):
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(code_corpus), "--out", str(run), "--no-progress",
                 f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1", "train.eval_batches=1"]) == 0
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    cfg = build_config("tiny")
    predicted = rank_memory(cfg, 1)[0]
    assert last["mem/rank0/peak_bytes"] > last["mem/rank0/baseline_bytes"] > 0
    # parameters + AdamW moments alive after the step (gradients freed; AdamW's step counter per tensor on top)
    held = predicted.params + predicted.optimizer
    assert held <= last["mem/rank0/tensor_bytes"] <= held + 8 * 64


def test_plan_prints_the_recommended_layouts_ranks(capsys):
    assert main(["plan", "--preset", "tiny", "--devices", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("ranks 0-3:"))
    assert "AdamW state" in line and "activations" in line
