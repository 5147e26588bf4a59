"""``torchrun --nproc_per_node 2 -m moetrain train`` (EP=2) trains like one process on the same global batch, logs
the per-rank token exchange, and writes a sharded checkpoint that one process resumes exactly.

The global-batch aux loss replaces the per-micro-batch Switch loss here: the Switch loss is computed on each rank's
own tokens (Megatron-Core's convention), so it alone is not the global batch's; every other term is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _parallel_util import free_port
from moetrain.cli import main

HIDDEN, TOP_K, MOE_LAYERS, BATCH, SEQ = 64, 2, 2, 8, 64  # the tiny preset


def _corpus(root: Path) -> Path:
    """A small directory of regular Python-like text (as conftest's ``code_corpus``)."""
    root.mkdir()
    for i in range(12):
        lines = []
        for j in range(150):
            lines += [f"def function_{i}_{j}(value, count={j}):",
                      f"    \"\"\"Return value scaled by {j} and shifted by count.\"\"\"",
                      f"    result = value * {j} + count - {i}", "    return result\n"]
        (root / f"module_{i:02d}.py").write_text("\n".join(lines))
    return root


def _args(tmp: Path, out: str) -> list[str]:
    return ["train", "--preset", "tiny", "--data", str(tmp / "corpus"), "--out", str(tmp / out), "--no-progress",
            f"data.cache_dir={tmp / 'cache'}", "train.steps=2", "train.log_every=1", "train.eval_batches=1",
            "model.moe.losses.aux_loss_coeff=0", "model.moe.losses.global_aux_loss_coeff=0.01"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cli")
    _corpus(tmp / "corpus")
    assert main(_args(tmp, "one")) == 0  # one process, in this process (also fills the data cache)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "-m", "moetrain", *_args(tmp, "ep2"), "parallel.ep=2"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (tmp / "ep2.log").write_text(proc.stdout + proc.stderr)
    return tmp


def test_two_steps_match_one_process(runs):
    one = {r["step"]: r for r in _records(runs / "one") if "train_loss" in r}
    ep2 = {r["step"]: r for r in _records(runs / "ep2") if "train_loss" in r}
    assert sorted(one) == sorted(ep2) == [1, 2]
    for step in (1, 2):
        assert abs(one[step]["train_loss"] - ep2[step]["train_loss"]) <= 1e-5, step
        assert abs(one[step]["grad_norm"] - ep2[step]["grad_norm"]) <= 1e-5, step
    assert one[2]["train_loss"] != one[1]["train_loss"]  # the first step changed the weights


def test_bytes_sent_match_routing_and_are_logged(runs):
    """Dropless, every (token, expert) assignment goes into the dispatch exchange: per step and rank,
    tokens_sent = (B / 2) * S * K per MoE layer, and bytes = tokens_sent * hidden * 4 (fp32). What the two ranks
    receive adds up to what they send."""
    for record in (r for r in _records(runs / "ep2") if "train_loss" in r):
        tokens_sent = BATCH // 2 * SEQ * TOP_K * MOE_LAYERS
        for rank in (0, 1):
            assert record[f"ep/rank{rank}/a2a_bytes_sent"] == tokens_sent * HIDDEN * 4
            assert 0 < record[f"ep/rank{rank}/a2a_bytes_sent_remote"] < tokens_sent * HIDDEN * 4
        assert record["ep/rank0/tokens_received"] + record["ep/rank1/tokens_received"] == 2 * tokens_sent


def test_only_rank_zero_writes(runs):
    log = (runs / "ep2.log").read_text()
    assert log.count("run directory:") == 1 and log.count("step 0: val_loss") == 1
    assert "parallel: mesh pp 1 x dp_replicate 1 x dp_shard 1 x ep 2 = 2 ranks" in log
    assert len(_records(runs / "ep2")) == len(_records(runs / "one"))  # one writer: no duplicated lines


@pytest.fixture(scope="module")
def resumed(runs) -> dict[str, dict]:
    """Step 3 of: the single-process run resumed by one process (the trusted path), and the EP=2 run's sharded
    checkpoint (verified through the checkpoint store) resumed by one process (resharded to EP=1)."""
    out = {}
    for name, extra in (("one", []), ("ep2", ["parallel.ep=1"])):
        run = runs / f"{name}-resumed"
        shutil.copytree(runs / name, run)
        assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-progress", *extra]) == 0
        out[name] = {r["step"]: r for r in _records(run) if "train_loss" in r}
    return out


def test_sharded_checkpoint_resumes_in_one_process(runs, resumed):
    ckpt = runs / "ep2" / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "model.safetensors").exists()
    assert abs(resumed["ep2"][3]["train_loss"] - resumed["one"][3]["train_loss"]) <= 1e-5
    assert resumed["one"][3]["train_loss"] != resumed["one"][2]["train_loss"]


def test_eval_loads_a_sharded_checkpoint(runs, capsys):
    """``moetrain eval`` (like generate and export) loads the EP=2 run's sharded checkpoint whole."""
    losses = {}
    for name in ("one", "ep2"):
        capsys.readouterr()
        assert main(["eval", str(runs / name), "--batches", "1"]) == 0
        losses[name] = float(capsys.readouterr().out.split()[1])
    assert losses["one"] == losses["ep2"]
