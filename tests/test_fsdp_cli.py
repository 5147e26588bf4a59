"""``torchrun ... -m moetrain train`` in every layout trains the model one process trains from the same
``train.seed``, with no initialisation flag (every layout initialises from global indices): ``parallel.dp_shard=2``,
``parallel.pp=2``, ``parallel.ep=2`` (2 processes each), ``parallel.pp=2 parallel.ep=2`` and ``parallel.dp_shard=2
parallel.ep=2`` (4; ``parallel.pp=2 parallel.dp_shard=2 parallel.ep=2`` on 8 with ``-m slow``), on the same global
batch: the training losses of steps 1-3 within 1e-6 relative, the validation losses within 1e-4, the parameters of
the final (step-3) checkpoints, read back resharded to one process, within 1e-5; the mesh line is printed; a pp=2 x
ep=2 checkpoint resumes in one process with the losses the job logged.

The model is the tiny preset's, its embedding tied to the LM head (across the pipeline's first and last stage).
The Switch loss is off (computed on each rank's rows, it is not the global batch's); the global-batch aux loss,
linear in the batch, is on; 2 micro-batches per step (the pipeline's micro-batches).
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
from test_parallel_cli import _corpus

LAYOUTS = {"dp_shard2": (2, ["parallel.dp_shard=2"]), "pp2": (2, ["parallel.pp=2"]), "ep2": (2, ["parallel.ep=2"]),
           "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2"]),
           "dp_shard2_ep2": (4, ["parallel.dp_shard=2", "parallel.ep=2"])}
SLOW_LAYOUTS = {"pp2_dp_shard2_ep2": (8, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"])}


def _args(tmp: Path, out: str, steps: int = 3) -> list[str]:
    return ["train", "--preset", "tiny", "--data", str(tmp / "corpus"), "--out", str(tmp / out), "--no-progress",
            f"data.cache_dir={tmp / 'cache'}", f"train.steps={steps}", "train.log_every=1", "train.eval_batches=1",
            "train.grad_accum=2", "train.ckpt_every=2",
            "model.moe.losses.aux_loss_coeff=0", "model.moe.losses.global_aux_loss_coeff=0.01", "train.device=cpu"]


def _losses(run: Path) -> dict[int, tuple]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        d = json.loads(line)
        if "train_loss" in d or "val_loss" in d:
            out[d["step"]] = (d.get("train_loss"), d.get("val_loss"))
    return out


def _torchrun(tmp: Path, name: str, world: int, extra: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), "-m", "moetrain", *_args(tmp, name), *extra],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    """The one-process run (the reference), in the directory the layouts' runs join."""
    tmp = tmp_path_factory.mktemp("fsdpcli")
    _corpus(tmp / "corpus")
    assert main(_args(tmp, "one")) == 0
    return tmp


@pytest.fixture(scope="module")
def runs(one) -> Path:
    for name, (world, extra) in LAYOUTS.items():
        _torchrun(one, name, world, extra)
    return one


def _final_params(run: Path) -> tuple[int, dict]:
    """(step, {name: tensor}) of the run's newest checkpoint, loaded (resharded) into one process's model."""
    from moetrain.commands.run_dir import load_run

    loaded = load_run(str(run))
    return loaded.checkpoint.step, {n: p.detach() for n, p in loaded.model.named_parameters()}


def _check_layout(runs: Path, name: str) -> None:
    want, got = _losses(runs / "one"), _losses(runs / name)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for step in want:
        (train_a, val_a), (train_b, val_b) = got[step], want[step]
        assert (train_a is None) == (train_b is None) and (val_a is None) == (val_b is None), (name, step, got, want)
        assert train_a is None or abs(train_a - train_b) <= 1e-6 * abs(train_b), (name, step, got, want)
        assert val_a is None or abs(val_a - val_b) <= 1e-4, (name, step, got, want)
    log = (runs / f"{name}.log").read_text()
    assert sum(line.startswith("parallel: ") for line in log.splitlines()) == 1, log[-2000:]  # rank 0's, once
    (step_a, mine), (step_b, ref) = _final_params(runs / name), _final_params(runs / "one")
    assert step_a == step_b == 3 and mine.keys() == ref.keys()
    worst = max((mine[k] - ref[k]).abs().max().item() for k in ref)
    print(name, "largest parameter difference after 3 steps", worst)
    assert worst <= 1e-5, (name, worst)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(runs, name):
    _check_layout(runs, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_8_process_layout_trains_like_one_process(one, name):
    """pp=2 x dp_shard=2 x ep=2 on 8 torchrun processes (2 rows of the 8-row batch per rank)."""
    _torchrun(one, name, *SLOW_LAYOUTS[name])
    _check_layout(one, name)


def test_pipeline_checkpoint_resumes_in_one_process(runs):
    """Copy the pp=2 x ep=2 run stopped at its step-2 checkpoint, resume it in one process: step 3's loss is the
    job's."""
    run = runs / "resumed"
    shutil.copytree(runs / "pp2_ep2", run)
    ckpts = run / "checkpoints"
    for d in ckpts.iterdir():
        if d.is_dir() and not d.name.endswith("00000002"):
            shutil.rmtree(d)
    assert main([*_args(runs, "resumed"), "--resume", "parallel.pp=1", "parallel.ep=1"]) == 0
    got, want = _losses(run), _losses(runs / "pp2_ep2")
    assert abs(got[3][0] - want[3][0]) <= 1e-5, (got, want)
