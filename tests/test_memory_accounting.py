"""Per-rank memory: the layout model (``--dry-run``'s lines, moetrain.parallel.memory) against the counts it must
agree with, the measured figures in metrics.jsonl, and the refusal of a model that does not fit a per-process cap
(naming the layout to try)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.parallel.dry_run import dry_run
from moetrain.parallel.memory import GRAD_BYTES, RUNTIME_CPU_BYTES, Unit, moe_scratch, rank_memory, step_moments
from moetrain.runtime import preflight
from moetrain.runtime.preflight import check_fits, human_bytes, reserved_bytes

PIPE = {"model": {"tie_embeddings": False}}


@pytest.mark.parametrize("parallel, world", [({}, 1), ({"dp_shard": 2}, 2), ({"dp_shard": 4}, 4), ({"ep": 2}, 2),
                                             ({"pp": 2}, 2), ({"dp_shard": 2, "reshard_after_forward": False}, 2)])
def test_state_is_the_dry_runs_and_its_parts_are_4_4_8(parallel, world):
    cfg = build_config("tiny", overrides={**PIPE, "parallel": parallel, "train": {"grad_accum": 2}})
    ranks = rank_memory(cfg, world, device="cpu")
    assert len(ranks) == cfg.parallel.pp
    assert max(r.state for r in ranks) == dry_run(cfg, world).rank_bytes
    for r in ranks:
        assert r.grads == r.params and r.optimizer == 2 * r.params and r.activations > 0
        # one engine: every layout on FSDP2, which holds unsharded copies even of a one-shard pipeline stage
        assert (r.gathered > 0) == (world > 1)
        assert r.grads_at_peak > 0
        assert r.total == pytest.approx(r.params + r.grads_at_peak + r.optimizer + r.gathered + r.comm
                                        + r.activations + r.scratch + r.runtime)


def test_sharding_divides_the_state_and_zero2_gathers_more():
    one = rank_memory(build_config("tiny", overrides=PIPE), 1, device="cpu")[0]
    cfg = build_config("tiny", overrides={**PIPE, "parallel": {"dp_shard": 4}})
    zero3 = rank_memory(cfg, 4, device="cpu")[0]
    zero2 = rank_memory(build_config("tiny", overrides={**PIPE, "parallel": {"dp_shard": 4,
                                                                             "reshard_after_forward": False}}), 4,
                        device="cpu")[0]
    assert one.state / 4 <= zero3.state <= one.state / 4 * 1.05  # padding of dim 0 to 4 rows
    assert zero2.state == zero3.state and zero2.gathered > zero3.gathered
    # a quarter of the rows each, of the blocks not yet run backward at the peak
    assert 0 < zero3.activations <= one.activations / 4 * 1.35


def test_dry_run_prints_each_ranks_parts(capsys):
    assert main(["train", "--preset", "tiny", "--dry-run", "--world-size", "2", "parallel.pp=2",
                 "model.tie_embeddings=false"]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"rank {rank} (pipeline rank {rank})"))
        for part in ("parameters", "gradients", "AdamW state", "gathered", "activations", "peak"):
            assert part in line, line


def test_dry_run_states_a_small_models_per_rank_state_in_units_that_read(capsys):
    """tiny over 4 shards: the state line gives the rank's exact parameter count and its bytes in KB (it read
    "0.00 GB ... (0.0M parameters; planner: 0.00 GB)")."""
    assert main(["train", "--preset", "tiny", "--dry-run", "--world-size", "4", "parallel.dp_shard=4"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("per rank: "))
    r = rank_memory(build_config("tiny", overrides={"parallel": {"dp_shard": 4}}), 4)[0]
    state = human_bytes(r.params + r.grads + r.optimizer)
    assert line.startswith(f"per rank: {state} of fp32 parameters") and state.endswith(" KB"), line
    assert f"({int(r.params) // 4:,} parameters; planner: {state})" in line, line


def test_a_model_over_the_free_memory_names_the_layout_that_fits():
    # 0.42 GB of state: large enough that sharding's gains outweigh each process's runtime (RUNTIME_CPU_BYTES)
    cfg = build_config("tiny", overrides={"model": {"hidden": 256, "n_layers": 4, "moe": {
        "num_experts": 8, "experts": {"ffn_hidden": 1024}}}, "train": {"batch_size": 4}})
    need = rank_memory(cfg, 1, device="cpu")[0]
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


def test_a_ranks_threads_stacks_are_three_per_gloo_group_and_the_writers(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * 2**20, resource.RLIM_INFINITY))
    cfg = build_config("tiny")
    # 8 groups (default + 7 of the mesh) x (2 gloo workers + 1 TCP loop) + rank 0's metrics writer, 8 MiB each
    assert reserved_bytes(cfg, 2) == 25 * 8 * 2**20 == 209_715_200
    pp4 = build_config("tiny", overrides={"parallel": {"pp": 4}, "model": {"n_layers": 4}})
    assert reserved_bytes(pp4, 4) == (3 * 9 + 1) * 8 * 2**20  # + the embedding's first-and-last-stage group
    assert reserved_bytes(cfg, 1) == 0.0 and reserved_bytes(cfg, 2, "cuda") == 0.0


def _gloo_threads(rank, world, out_dir, parallel):
    import torch

    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.layout import Layout, build_layout_mesh, process_groups

    layout = Layout.from_config(ParallelConfig(**parallel), world)
    build_layout_mesh(layout, 30, torch.device("cpu"))
    groups = process_groups(layout)

    def count() -> int:
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                names.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
            except OSError:  # a thread that ended between the listing and the read
                pass
        return sum(n in ("pt_gloo_runloop", "gloo_tcp_loop") for n in names)

    deadline = time.monotonic() + 10  # a group's worker threads start asynchronously, after the group exists
    while count() < 3 * groups and time.monotonic() < deadline:
        time.sleep(0.05)
    return count(), groups


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
def test_a_rank_runs_the_gloo_threads_counted_for_its_stacks(tmp_path):
    from _parallel_util import spawn

    for threads, groups in spawn(_gloo_threads, 2, tmp_path, {"dp_shard": 2}):
        assert groups == 8 and threads == preflight.GLOO_THREADS_PER_GROUP * groups == 24


def test_an_address_space_limit_counts_each_ranks_thread_stacks(monkeypatch):
    # The capacity demonstration's model (80M parameters); this process may map 1.1 GB more under RLIMIT_DATA.
    # dp_shard=2's rank: 999.2 MB resident at its peak + 209.7 MB of stacks > 1.1 GB; dp_shard=4's: 717.6 + 209.7.
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * 2**20, resource.RLIM_INFINITY))
    model = {"hidden": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 1024, "tie_embeddings": False,
             "moe": {"num_experts": 8, "experts": {"ffn_hidden": 1536}}}
    run = {"model": model, "train": {"batch_size": 4}, "data": {"seq_len": 32}}
    cfg, sharded = build_config("tiny", overrides=run), build_config("tiny", overrides={**run, "parallel": {
        "dp_shard": 2}})
    free = 1.1e9
    monkeypatch.setattr(preflight, "process_limit", lambda: ("RLIMIT_DATA", free))
    monkeypatch.setattr(preflight, "available_memory", lambda device_type="cpu": free)
    two = max(r.total for r in rank_memory(sharded, 2, device="cpu"))
    assert round(two / 1e5) == 9992 and two < free < two + 25 * 8 * 2**20  # the stacks decide
    with pytest.raises(ConfigError, match=r"under its RLIMIT_DATA limit.*try parallel.dp_shard=4 on 4 processes"
                                          r".*\(about 927.3 MB per process\)"):
        check_fits(cfg)
    with pytest.raises(ConfigError, match=r"per rank for weights.*try parallel.dp_shard=4"):
        check_fits(sharded, world=2)  # a rank refuses before allocating, not in its second step
    check_fits(sharded, world=2, free=free)  # the free memory given, not a limit: no stacks counted


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


def test_an_allocation_that_fails_in_a_step_is_one_line_naming_the_layouts_to_try(tmp_path, code_corpus, capsys,
                                                                                    monkeypatch):
    """A step that needs more than the estimate let through (as ``parallel.dp_shard=2`` under the capacity
    demonstration's ``RLIMIT_DATA``: FSDP2's 78.6 MB all-gather in step 2) ends with one line and exit 1, not the
    allocator's traceback. The failure here is the CPU allocator's own, asked for 1 PB inside the first step."""
    import torch

    from moetrain.parallel.launch import ParallelHooks

    def step(*args, **kwargs):
        torch.empty(2**50, dtype=torch.uint8)

    monkeypatch.setattr(ParallelHooks, "train_step", step)
    assert main(["train", "--preset", "tiny", "--data", str(code_corpus), "--out", str(tmp_path / "run"),
                 "--no-progress", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("moetrain: error: rank 0: out of memory: allocating 1.1 PB failed in this process")
    assert "parallel.dp_shard=2 on 2 processes" in err[0] and "train.batch_size" in err[0]


def test_plan_prints_the_recommended_layouts_ranks(capsys):
    assert main(["plan", "--preset", "tiny", "--devices", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("ranks 0-3:"))
    assert "AdamW state" in line and "activations" in line


# Hand-derived moments of a 3-unit rank (embedding, one block, the tail), fp32 (c = 4), 2 shards over gloo: unit sizes
# in elements, activations in bytes.
EMBED, BLOCK, TAIL = Unit("embed", 100, 50, 0, True), Unit("blocks.0", 1000, 500, 600, True), Unit("tail", 200, 100, 0,
                                                                                                      True)


def _moment(moments, name):
    return next(m for m in moments if m.name == name)


def test_zero3_backward_holds_the_unit_its_gradient_the_prefetch_with_glooss_copy_and_the_kept_reduce_input():
    moments = step_moments([EMBED, BLOCK, TAIL], [0.0, 3000.0, 700.0], 0.0, 4, zero3=True, gloo=True,
                           accumulate=False, first_acts=0.0)
    m = _moment(moments, "backward of blocks.0")
    assert m.grads == 100 * 4 + 1000 * 4  # the tail's reduced shard, the block's unsharded gradient
    assert m.gathered == 1000 * 4  # the block's parameters
    # the embedding's all-gather prefetched (FSDP2's flat output + gloo's flat copy), the tail's reduce-scatter input
    assert m.comm == 2 * 100 * 4 + 200 * 4
    assert m.activations == 3000.0  # the block's and the embedding's (none): the tail's are freed
    r = _moment(moments, "reduce-scatter of blocks.0")
    assert r.comm == 1000 * 4 + 1000 * 4 + 2 * 100 * 4  # FSDP2's flat input + gloo's clone of it + the prefetch
    assert r.grads == 100 * 4 + 500 * 4 and r.gathered == 0
    nccl = step_moments([EMBED, BLOCK, TAIL], [0.0, 3000.0, 700.0], 0.0, 4, zero3=True, gloo=False,
                        accumulate=False, first_acts=0.0)
    assert _moment(nccl, "reduce-scatter of blocks.0").comm == 1000 * 4 + 100 * 4  # no copies on NCCL
    assert _moment(moments, "the optimizer step").grads == (50 + 500 + 100) * 4


def test_zero2_and_one_unit_stages_keep_every_unit_gathered_until_its_backward():
    moments = step_moments([EMBED, BLOCK, TAIL], [0.0, 3000.0, 700.0], 0.0, 4, zero3=False, gloo=True,
                           accumulate=False, first_acts=0.0)
    assert _moment(moments, "backward of tail").gathered == (100 + 1000 + 200) * 4
    assert _moment(moments, "reduce-scatter copy-in of tail").gathered == (100 + 1000) * 4
    # a pipeline stage without data parallelism: one unit, copied (no collective), accumulating 2 micro-batches
    stage = Unit("stage", 1300, 1300, 600, False)
    moments = step_moments([stage], [3700.0], 0.0, 4, zero3=False, gloo=True, accumulate=True, first_acts=7400.0)
    m = _moment(moments, "backward of stage")
    assert m.gathered == 1300 * 4 and m.comm == 0
    assert m.grads == 1300 * 4 + 600 * 4  # the accumulated unsharded gradient + one MoE backward's fresh one
    assert _moment(moments, "reduce-scatter of stage").comm == 1300 * 4  # the flat input, no gloo clone
    first = _moment(moments, "first backward of stage")
    assert first.activations == 7400.0 and first.gathered == 1300 * 4


def test_moe_scratch_is_the_fused_paths_kept_buffers():
    from moetrain.analysis.shape import ModelShape

    cfg = build_config("tiny", overrides={"model": {"hidden": 256, "moe": {"num_experts": 8,
                                                                           "experts": {"ffn_hidden": 1024}}}})
    shape = ModelShape.from_config(cfg.model)
    assert shape.fused_experts and shape.expert_mats == 3
    d, f, k, seq = 256, 1024, shape.top_k, cfg.data.seq_len
    fwd, bwd = 8 * seq * k, 4 * seq * k  # rows: the evaluation's 8 sequences, training's 4
    want = (fwd * (2 * d + f) + bwd * (3 * d + 2 * f + 2 * f)) * 4  # y, xs, a; dx, g, xs, dz, a, dh
    assert moe_scratch(shape, 4, 8, seq, 4) == want
    # measured (strace of glibc's mmaps, 2 gloo ranks, 4 + 8 rows of 64 tokens, k = 2): 16.3 MB
    if k == 2 and seq == 64:
        assert want == pytest.approx(16.3e6, rel=0.01)


def test_cpu_counts_the_runtime_and_scratch_cuda_does_not():
    cfg = build_config("tiny", overrides={**PIPE, "parallel": {"dp_shard": 2}})
    cpu, cuda = rank_memory(cfg, 2, device="cpu")[0], rank_memory(cfg, 2, device="cuda")[0]
    assert cpu.runtime == RUNTIME_CPU_BYTES and cuda.runtime == 0 and cuda.scratch == 0 < cpu.scratch
    assert cuda.state == cpu.state and cuda.total < cpu.total


def test_a_one_shard_pipeline_stage_holds_an_unsharded_copy_of_its_parameters():
    cfg = build_config("tiny", overrides={**PIPE, "parallel": {"pp": 2}, "train": {"grad_accum": 2}})
    for r in rank_memory(cfg, 2, device="cpu"):
        assert r.gathered == r.params  # FSDP2's world-size-1 copy, fp32
        assert r.grads_at_peak >= r.grads  # the accumulated unsharded gradients
    assert GRAD_BYTES == 4


def test_the_timeline_tracer_counts_live_buffers_from_every_thread_by_where_they_were_allocated(tmp_path):
    """benchmarks/memory_timeline.py's parser on a hand-written strace log: two threads, an interleaved call, a
    1 MiB interpreter arena (left out), a buffer from before the start and one after the last memory record."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from memory_timeline import parse

    anon = "PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0"
    mark = 'access("/moetrain-mark/{}", F_OK) = -1 ENOENT (No such file or directory)'
    log = [f"100 1.0 mmap(NULL, 4096000, {anon}) = 0x7f0000000000",
           f"100 1.1 {mark.format('START')}",
           f"100 1.2 {mark.format('B_model_build')}",
           f"100 1.3 mmap(NULL, 1000000, {anon}) = 0x7f1000000000",
           f"100 1.4 {mark.format('E_model_build')}",
           f"100 1.5 {mark.format('B_backward')}",
           f"101 1.6 mmap(NULL, 3000000, {anon} <unfinished ...>",
           f"100 1.65 mmap(NULL, 1048576, {anon}) = 0x7f3000000000",
           "101 1.7 <... mmap resumed>) = 0x7f2000000000",
           "101 1.8 munmap(0x7f2000000000, 3000000) = 0",
           f"100 1.9 {mark.format('E_backward')}",
           f"100 2.0 {mark.format('RECORD')}",
           f"100 2.1 mmap(NULL, 9000000, {anon}) = 0x7f4000000000"]
    (tmp_path / "trace.0").write_text("\n".join(log) + "\n")
    peak = parse(tmp_path / "trace.0")
    assert peak["bytes"] == 1000000 + 3000000 and peak["open"] == ["backward"]
    assert peak["by_site"] == {"before the model": 4096000, "model build": 1000000, "backward": 3000000}
