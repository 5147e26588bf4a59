"""Killing the last rank of an FSDP2 job (``parallel.dp_shard=2``, ``dp_shard=2 x ep=2``) or a pipeline job
(``parallel.pp=2``, ``pp=2 x ep=2``, ``pp=2 x dp_shard=2 x ep=2``) in the middle of a step makes every other rank
exit non-zero within ``parallel.timeout_s`` with one line naming the collective it was in: FSDP2's all-gather /
reduce-scatter, the pipeline's stage send / recv (or a collective moetrain names itself, such as the MoE token
exchange, with the step it was in).

The ranks are plain processes with torchrun's environment (as in test_parallel_faults.py). The victim dies by
SIGKILL inside the step: once the job has logged a step, the test creates a flag file, and the victim's next
pipeline send / recv (``torch.distributed.pipelining.schedules._batch_p2p``) or FSDP2 reduce-scatter
(``foreach_reduce``) kills it (a ``sitecustomize`` on the victim's ``PYTHONPATH`` only). A kill from outside at a
random time lands as often between steps (in the routing-alarm broadcast or the stop all-reduce: then the line names
that collective, as test_parallel_faults.py checks). The 4 default jobs run in two batches (the 2-rank jobs, then the
4-rank ones); a job whose victim exited by itself before the injected kill runs once more (its survivors must not
have hung even so). The 8-rank job is ``-m slow``.
"""

from __future__ import annotations

import os
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
# What may pass between the victim's death and a survivor's exit besides the wait that parallel.timeout_s bounds:
# the error line, destroy_process_group and the interpreter's teardown. Measured 2026-12-01 (Intel Xeon, 2 cores at
# load 8-15): the survivors of the 2-, 4- and 8-rank jobs exited 1.0-8.4 s after the kill (a dead peer closes its
# sockets, so no survivor waited for the time-out); 15 s leaves ~2x.
MARGIN_S = 15
PIPE = ["model.tie_embeddings=false", "train.grad_accum=2"]
JOBS = {"dp_shard2": (2, ["parallel.dp_shard=2"]),
        "pp2": (2, ["parallel.pp=2", *PIPE]),
        "dp_shard2_ep2": (4, ["parallel.dp_shard=2", "parallel.ep=2"]),
        "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2", *PIPE]),
        "pp2_dp_shard2_ep2": (8, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", *PIPE])}
SLOW = {"pp2_dp_shard2_ep2"}
INJECT = """import os, signal
import torch.distributed  # noqa: F401


def _dying(orig):
    def call(*args, **kwargs):
        if os.path.exists(os.environ["MOETRAIN_TEST_KILL_FLAG"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(*args, **kwargs)
    return call


if os.environ["MOETRAIN_TEST_KILL_IN"] == "p2p":
    from torch.distributed.pipelining import schedules as where
    where._batch_p2p = _dying(where._batch_p2p)
else:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as where
    where.foreach_reduce = _dying(where.foreach_reduce)
"""


def _pipeline(name: str) -> bool:
    return "parallel.pp=2" in JOBS[name][1]


def _launch(tmp: Path, name: str, world: int) -> list[subprocess.Popen]:
    """Start the ``world`` ranks of job ``name`` (its ``JOBS`` overrides) as plain processes; the last one dies at
    its first pipeline send / recv or FSDP2 reduce-scatter after ``tmp / name.kill`` exists."""
    port = free_port()
    inject = tmp / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(INJECT)
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        if rank == world - 1:
            env.update(PYTHONPATH=os.pathsep.join([str(inject), env.get("PYTHONPATH", "")]),
                       MOETRAIN_TEST_KILL_FLAG=str(tmp / f"{name}.kill"),
                       MOETRAIN_TEST_KILL_IN="p2p" if _pipeline(name) else "reduce_scatter")
        args = [sys.executable, "-m", "moetrain", "train", "--preset", "tiny", "--data", str(tmp / "corpus"),
                "--out", str(tmp / name), "--no-progress", f"data.cache_dir={tmp / 'cache'}", "train.steps=100000",
                "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0", "train.eval_batches=1",
                "train.device=cpu", f"parallel.timeout_s={TIMEOUT_S}", *JOBS[name][1]]  # the job's fields win
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _run_jobs(tmp: Path, names: list[str]) -> dict:
    """Start the jobs at once; raise each job's kill flag once it logged a step; time from the victim's death to
    each other rank's exit (all polled every 0.1 s); collect return codes and stderr (the victim's too). Once a
    job's victim is gone its survivors get ``TIMEOUT_S + 2 * MARGIN_S`` to exit before they are killed and
    recorded as hung (``rc`` None)."""
    tmp.mkdir(parents=True, exist_ok=True)
    _corpus(tmp / "corpus")
    cfg = build_config("tiny", overrides={"data": {"path": str(tmp / "corpus"), "cache_dir": str(tmp / "cache")}})
    prepare_data(cfg.data, cfg.model.vocab_size, log=lambda _: None)
    jobs = {name: _launch(tmp, name, JOBS[name][0]) for name in names}
    out: dict = {name: {"survivors": {}} for name in names}
    try:
        deadline = time.monotonic() + 600
        waiting = {(name, rank) for name in names for rank in range(JOBS[name][0])}
        while waiting and time.monotonic() < deadline:
            for name, rank in sorted(waiting, key=lambda w: (w[0], -w[1])):  # a victim before its survivors
                procs, r = jobs[name], out[name]
                if "flag_at" not in r and _trained_a_step(tmp / name):
                    (tmp / f"{name}.kill").touch()
                    r["flag_at"] = time.monotonic()
                if procs[rank].poll() is None:
                    if time.monotonic() > r.get("fault_at", float("inf")) + TIMEOUT_S + 2 * MARGIN_S:
                        procs[rank].kill()  # hung: recorded below with rc None
                        waiting.discard((name, rank))
                    continue
                waiting.discard((name, rank))
                now = time.monotonic()
                if rank == len(procs) - 1:
                    r["fault_at"], r["victim_rc"] = now, procs[rank].returncode
                else:
                    r["survivors"][rank] = {"rc": procs[rank].returncode, "exit_at": now}
            time.sleep(0.1)
        for name, procs in jobs.items():
            for rank, p in enumerate(procs):
                if p.poll() is None:  # a survivor that hangs: the bug this test exists for
                    p.kill()
                _, stderr = p.communicate()
                if rank < len(procs) - 1:
                    s = out[name]["survivors"].setdefault(rank, {"rc": None, "exit_at": float("inf")})
                    s["stderr"] = stderr
                    s["seconds"] = s["exit_at"] - out[name].get("fault_at", float("inf"))
                else:
                    out[name]["victim_stderr"] = stderr
    finally:
        for procs in jobs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    return out


def _injected(r: dict) -> bool:
    """Whether the victim died of the injected SIGKILL after the flag (what the checks are about)."""
    return "flag_at" in r and r.get("victim_rc") == -9


def _run_batches(tmp: Path, batches: list[list[str]]) -> dict:
    """:func:`_run_jobs` batch by batch (fewer processes on the cores at once); a job whose victim did not die of
    the injected kill in the step (it exited by itself first: the fault was not the one under test) runs once
    more, and both attempts are kept (``out[name]["first_attempt"]``) and printed."""
    out: dict = {}
    for i, batch in enumerate(batches):
        out.update(_run_jobs(tmp / f"batch{i}", batch))
    again = [name for name in out if not _injected(out[name])]
    if again:
        first = {name: out[name] for name in again}
        for name in again:
            print(f"{name}: the fault was not injected in the step (victim rc {first[name].get('victim_rc')}); "
                  f"running it again. victim stderr: {first[name].get('victim_stderr', '')[-2000:]}")
        out.update(_run_jobs(tmp / "again", again))
        for name in again:
            out[name]["first_attempt"] = first[name]
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    # two processes per job in the first batch, four in the second (12 at once on 2 cores made one CI run's victim
    # outlive its kill flag by 108 s)
    names = [name for name in JOBS if name not in SLOW]
    return _run_batches(tmp_path_factory.mktemp("fsdpfaults"), [[n for n in names if JOBS[n][0] == 2],
                                                                 [n for n in names if JOBS[n][0] > 2]])


def _check(name: str, r: dict) -> None:
    if "first_attempt" in r:  # the victim exited by itself first: still, no rank may hang after it
        a = r["first_attempt"]
        hung = [rank for rank, s in a["survivors"].items() if "fault_at" in a and s["rc"] is None]
        assert not hung, (f"ranks {hung} hung after the victim exited {a.get('victim_rc')} (first attempt); victim: "
                          f"{a.get('victim_stderr', '')[-2000:]}; rank 0: {a['survivors'][0]['stderr'][-2000:]}")
    first = r["survivors"][0]["stderr"]
    assert "flag_at" in r, f"the job ended before it logged a step: {first[-2000:]}"
    assert r.get("victim_rc") == -9, (f"the victim did not die in the step: {r.get('victim_rc')}, "
                                      f"victim: {r.get('victim_stderr', '')[-3000:]}, rank 0: {first[-2000:]}")
    step = "stage send / recv" if _pipeline(name) else "FSDP2 all-gather / reduce-scatter"
    assert sorted(r["survivors"]) == list(range(JOBS[name][0] - 1))
    for rank, s in sorted(r["survivors"].items()):
        assert s["rc"] not in (0, None, -9), (rank, s["stderr"][-2000:])
        errors = [line for line in s["stderr"].splitlines() if line.startswith("moetrain: error:")]
        assert len(errors) == 1, (rank, s["stderr"][-3000:])
        assert f"rank {rank}: collective " in errors[0] and step in errors[0], errors[0]
        assert 0 <= s["seconds"] <= TIMEOUT_S + MARGIN_S, (rank, s["seconds"])
        print(f"{name}: rank {rank} exited {s['rc']} {s['seconds']:.1f} s after the kill: {errors[0][:400]}")


@pytest.mark.parametrize("name", [name for name in JOBS if name not in SLOW])
def test_survivor_fails_naming_the_collective(outcomes, name):
    _check(name, outcomes[name])


@pytest.mark.slow
def test_survivors_of_8_ranks_fail_naming_the_collective(tmp_path):
    """pp=2 x dp_shard=2 x ep=2: the 7 survivors (~60 s to the first step on 2 busy cores)."""
    _check("pp2_dp_shard2_ep2", _run_jobs(tmp_path, ["pp2_dp_shard2_ep2"])["pp2_dp_shard2_ep2"])


def test_step_errors_name_the_engine_collectives_and_others_pass_through():
    """A backend error raised inside FSDP2 or the pipeline schedule (their collectives are not wrapped one by
    one) becomes one line naming the step's collectives; any other error is left as it is."""
    import torch.distributed as dist

    from functools import partial

    from moetrain.parallel.comm import CollectiveError, named_collective

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        _check_wrapping(CollectiveError, partial(named_collective, step=True))
    finally:
        dist.destroy_process_group()


def _check_wrapping(CollectiveError, fsdp_collectives) -> None:
    with pytest.raises(CollectiveError, match=r"collective pipeline step \(stage send / recv.*Connection closed"):
        with fsdp_collectives("pipeline step (stage send / recv of activations and gradients)"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33495")
    # torch.distributed.pipelining re-raises a stage's failed backward as a RuntimeError naming no collective
    with pytest.raises(CollectiveError, match=r"collective pipeline step .*failed on rank 0 .*: \[gloo.*Read error"):
        with fsdp_collectives("pipeline step"):
            try:
                raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:62119: reset")
            except RuntimeError as e:
                raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: Tensor") from e
    # a collective moetrain names itself keeps its name, with the step as context
    with pytest.raises(CollectiveError, match=r"^collective all_to_all_single \(MoE\) .*within the step: pipeline"):
        with fsdp_collectives("pipeline step"):
            try:
                raise CollectiveError("collective all_to_all_single (MoE) over ranks [0, 1] failed on rank 0: x")
            except CollectiveError as e:
                raise RuntimeError("Failed to run stage backward:") from e
    with pytest.raises(RuntimeError, match="^mat1 and mat2 shapes cannot be multiplied$"):
        with fsdp_collectives("FSDP2 all-gather"):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="^Failed to run stage backward:$"):  # its cause is no collective's
        with fsdp_collectives("pipeline step"):
            try:
                raise ValueError("shapes")
            except ValueError as e:
                raise RuntimeError("Failed to run stage backward:") from e


@pytest.mark.parametrize("engine", ["ep", "train"])
def test_nccl_groups_raise_instead_of_tearing_down(monkeypatch, engine):
    """The one process-group start (``init_layout_mesh``: the trainer's through ``start``, expert-parallel
    serving's directly; layouts ``dp_shard=2`` and ``ep=2``) sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` before the NCCL group exists, unless the
    environment sets it, and gives the group ``parallel.timeout_s`` (the watchdog's time-out). Runs without a GPU:
    ``init_process_group`` is replaced by a recorder."""
    import datetime

    import torch
    import torch.distributed as dist

    from moetrain.parallel.launch import start
    from moetrain.parallel.layout import NCCL_ERROR_HANDLING, init_layout_mesh

    class Recorded(Exception):
        pass

    seen = []

    def record(backend, timeout=None, device_id=None, **_):
        seen.append((backend, os.environ.get(NCCL_ERROR_HANDLING), timeout))
        raise Recorded

    monkeypatch.setattr(dist, "init_process_group", record)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    parallel = {"backend": "nccl", "timeout_s": 7, **({"dp_shard": 2} if engine == "train" else {"ep": 2})}
    cfg = build_config("tiny", overrides={"parallel": parallel})
    for preset in (None, "3"):
        if preset is None:
            monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
        else:
            monkeypatch.setenv(NCCL_ERROR_HANDLING, preset)
        with pytest.raises(Recorded):
            start(cfg, "cuda") if engine == "train" else init_layout_mesh(cfg.parallel, "cuda")
    assert seen == [("nccl", "2", datetime.timedelta(seconds=7)), ("nccl", "3", datetime.timedelta(seconds=7))]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 2, reason="a killed NCCL peer needs 2 GPUs (NCCL refuses 2 ranks on one device)")
def test_nccl_survivor_fails_naming_the_collective(tmp_path):
    """dp_shard=2 on NCCL: the peer dies in its reduce-scatter; the survivor's NCCL kernel never completes (a dead
    peer on NVLink / shared memory reports nothing), the watchdog times it out after parallel.timeout_s, aborts the
    communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) and the survivor prints one line naming the collective."""
    JOBS["nccl_dp_shard2"] = (2, ["parallel.dp_shard=2", "parallel.backend=nccl", "train.device=cuda"])
    try:
        _check("nccl_dp_shard2", _run_jobs(tmp_path, ["nccl_dp_shard2"])["nccl_dp_shard2"])
    finally:
        del JOBS["nccl_dp_shard2"]
