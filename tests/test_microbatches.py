"""The pipeline's micro-batches chosen from the layout when ``train.grad_accum`` is not set: ``parallel.pp=2`` on a
hand-written command (default ``grad_accum=1``) trains, keeping the step's sequences where they split, and says so;
a value the user set is never changed (too few still fails with the schedule's own error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _parallel_util import free_port
from moetrain.cli import main
from moetrain.config import build_config
from moetrain.parallel import microbatches
from moetrain.parallel.config import ParallelConfig
from test_parallel_cli import _corpus

PP = {"parallel": {"pp": 2}, "model": {"tie_embeddings": False}}
# One process initialised as the sharded engines are (from global indices), where that is still an option.
SAME_INIT = ["parallel.meta_init=true"] if "meta_init" in ParallelConfig.__dataclass_fields__ else []


def test_chosen_from_the_layout_keeping_the_step():
    cfg = build_config("tiny", overrides=PP)  # batch_size 8, grad_accum 1
    chosen, note = microbatches.choose(cfg, world=2)
    assert (chosen.train.grad_accum, chosen.train.batch_size) == (2, 4)
    assert chosen.train.grad_accum * chosen.train.batch_size == cfg.train.batch_size
    assert note is not None and "train.grad_accum=2" in note and "keeps its 8 sequences" in note
    # 4 stages (2 per rank) on 4 ranks (dp_shard 2): 8 sequences split into 4 micro-batches of 2 (1 per rank)
    cfg = build_config("tiny", overrides={**PP, "parallel": {"pp": 2, "pp_stages_per_rank": 2,
                                                             "pp_schedule": "interleaved_1f1b", "dp_shard": 2}})
    chosen, _ = microbatches.choose(cfg, world=4)
    assert (chosen.train.grad_accum, chosen.train.batch_size) == (4, 2)


def test_an_uneven_batch_grows_the_step_and_says_why():
    cfg = build_config("tiny", overrides={**PP, "train": {"batch_size": 3}})
    chosen, note = microbatches.choose(cfg, world=2)
    assert (chosen.train.grad_accum, chosen.train.batch_size) == (2, 3)
    assert note is not None and "a step of 6 sequences" in note


@pytest.mark.parametrize("overrides", [{"parallel": {"pp": 1}}, {"parallel": {"pp": 2, "pp_schedule": "gpipe"}},
                                       {"parallel": {"pp": 2}, "train": {"grad_accum": 3}}])
def test_nothing_to_choose(overrides):
    cfg = build_config("tiny", overrides={**PP, **overrides})
    world = cfg.parallel.pp
    assert microbatches.choose(cfg, world) == (cfg, None)


def test_given_reads_every_source():
    assert not microbatches.given(None, {}, {"train": {"steps": 2}})
    assert microbatches.given(None, {"train": {"grad_accum": 1}})
    assert microbatches.given({"train": {"grad_accum": 4}}, None)


def test_dry_run_says_the_choice_and_a_set_value_is_kept(capsys):
    args = ["train", "--preset", "tiny", "--dry-run", "--world-size", "2", "parallel.pp=2",
            "model.tie_embeddings=false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train.grad_accum was not set: train.grad_accum=2, train.batch_size=4" in out
    assert main([*args, "train.grad_accum=1"]) == 2
    assert "train.grad_accum: 1 micro-batches per step are fewer than the 2" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_pp2_default_trains_the_one_process_step(tmp_path):
    """``torchrun --nproc_per_node 2 ... parallel.pp=2`` with the default ``grad_accum``: 2 micro-batches of 4
    sequences per step, the log line says so, and the losses equal one process's on the same 8 sequences per step."""
    _corpus(tmp_path / "corpus")
    common = ["train", "--preset", "tiny", "--data", str(tmp_path / "corpus"), "--no-progress",
              f"data.cache_dir={tmp_path / 'cache'}", "train.steps=2", "train.log_every=1", "train.eval_batches=1",
              "model.tie_embeddings=false", "model.moe.losses.aux_loss_coeff=0"]
    assert main([*common, "--out", str(tmp_path / "one"), *SAME_INIT]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "-m", "moetrain", *common, "--out", str(tmp_path / "pp2"),
         "parallel.pp=2"], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train.grad_accum was not set: train.grad_accum=2, train.batch_size=4" in proc.stdout
    saved = json.loads((tmp_path / "pp2" / "config.json").read_text())["train"]
    assert (saved["grad_accum"], saved["batch_size"]) == (2, 4)  # a resume keeps them

    def losses(run: Path) -> list[float]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["train_loss"] for r in records if "train_loss" in r]

    one, pp2 = losses(tmp_path / "one"), losses(tmp_path / "pp2")
    assert len(one) == len(pp2) == 2 and one[0] != one[1]
    assert max(abs(a - b) for a, b in zip(one, pp2)) <= 1e-5, (one, pp2)
