"""Killing one rank of a 2-rank FSDP2 job (``parallel.dp_shard=2``) or pipeline job (``parallel.pp=2``) makes the
survivor exit non-zero within ``parallel.timeout_s`` with one line naming the collective it was in (FSDP2's
all-gather / reduce-scatter, the pipeline's send / recv), as the plain EP job does (test_parallel_faults.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _parallel_util import free_port
from moetrain.config import build_config
from moetrain.data.dataset import prepare_data
from test_parallel_cli import _corpus
from test_parallel_faults import _trained_a_step

TIMEOUT_S = 30
JOBS = {"dp_shard2": ["parallel.dp_shard=2"], "pp2": ["parallel.pp=2", "model.tie_embeddings=false", "train.grad_accum=2"]}


def _launch(tmp: Path, name: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        args = [sys.executable, "-m", "moetrain", "train", "--preset", "tiny", "--data", str(tmp / "corpus"),
                "--out", str(tmp / name), "--no-progress", f"data.cache_dir={tmp / 'cache'}", "train.steps=100000",
                "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0", "train.eval_batches=1",
                f"parallel.timeout_s={TIMEOUT_S}", *JOBS[name]]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fsdpfaults")
    _corpus(tmp / "corpus")
    cfg = build_config("tiny", overrides={"data": {"path": str(tmp / "corpus"), "cache_dir": str(tmp / "cache")}})
    prepare_data(cfg.data, cfg.model.vocab_size, log=lambda _: None)
    jobs = {name: _launch(tmp, name) for name in JOBS}
    out: dict = {}
    try:
        deadline, pending = time.monotonic() + 300, set(jobs)
        while pending and time.monotonic() < deadline:
            for name in list(pending):
                survivor, victim = jobs[name]
                if survivor.poll() is not None:
                    pending.discard(name)
                elif _trained_a_step(tmp / name):
                    os.kill(victim.pid, signal.SIGKILL)
                    out[name] = {"fault_at": time.monotonic()}
                    pending.discard(name)
            time.sleep(0.2)
        for name, (survivor, _) in jobs.items():
            try:
                _, stderr = survivor.communicate(timeout=TIMEOUT_S + 90)
            except subprocess.TimeoutExpired:  # the survivor hangs: the bug this test exists for
                survivor.kill()
                _, stderr = survivor.communicate()
            end = time.monotonic()
            out.setdefault(name, {}).update(rc=survivor.returncode, stderr=stderr,
                                            seconds=end - out.get(name, {}).get("fault_at", end))
    finally:
        for procs in jobs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    return out


@pytest.mark.parametrize("name", list(JOBS))
def test_survivor_fails_naming_the_collective(outcomes, name):
    r = outcomes[name]
    assert "fault_at" in r, f"the job ended before the fault was injected: {r['stderr'][-2000:]}"
    assert r["rc"] not in (0, None, -9), r["stderr"][-2000:]
    errors = [line for line in r["stderr"].splitlines() if line.startswith("moetrain: error:")]
    assert len(errors) == 1, r["stderr"][-3000:]
    assert "rank 0: collective " in errors[0], errors[0]
    assert r["seconds"] <= TIMEOUT_S + 60, r["seconds"]
    print(f"{name}: rank 0 exited {r['rc']} {r['seconds']:.1f} s after the fault: {errors[0]}")


def test_step_errors_name_the_engine_collectives_and_others_pass_through():
    """A backend error raised inside FSDP2 or the pipeline schedule (their collectives are not wrapped one by
    one) becomes one line naming the step's collectives; any other error is left as it is."""
    import torch.distributed as dist

    from moetrain.parallel.comm import CollectiveError
    from moetrain.parallel.engine import fsdp_collectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        _check_wrapping(CollectiveError, fsdp_collectives)
    finally:
        dist.destroy_process_group()


def _check_wrapping(CollectiveError, fsdp_collectives) -> None:
    with pytest.raises(CollectiveError, match=r"collective pipeline step \(stage send / recv.*Connection closed"):
        with fsdp_collectives("pipeline step (stage send / recv of activations and gradients)"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33495")
    with pytest.raises(RuntimeError, match="^mat1 and mat2 shapes cannot be multiplied$"):
        with fsdp_collectives("FSDP2 all-gather"):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
