"""Restarts without a person, and several nodes, through torchrun's own elastic agent and c10d rendezvous on
127.0.0.1 (``-m slow``: each job is a few torchrun starts on 2 shared cores).

- **Elastic restart**: ``torchrun --max-restarts 1``; one rank is killed (SIGKILL) in step 4; the agent restarts
  the group, ``moetrain train`` sees ``TORCHELASTIC_RESTART_COUNT=1`` and resumes ``--out`` from its newest verified
  checkpoint by itself (the command has no ``--resume``); the final checkpoint (weights and AdamW moments) is bit for
  bit an uninterrupted run's, every step's loss is the uninterrupted run's, and ``metrics.jsonl`` records the
  restart and the steps lost.
- **Two nodes**: two agents (``--nnodes 2 --nproc_per_node 1``, ``--rdzv-backend c10d``, one hosting the rendezvous
  store) train the losses of one agent with two processes.
- **A node lost and rejoining**: the non-hosting agent and its worker are killed in step 4; the hosting agent
  (``--max-restarts 1``) restarts and waits in the rendezvous; a new agent started with the same command joins; the
  job resumes and ends bit for bit as the uninterrupted run. Every node's command carries ``--resume`` (a node that
  rejoins is a new agent whose restart count starts at 0; ``--resume`` starts the run when ``--out`` does not exist).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _parallel_util import free_port
from moetrain.config import build_config
from moetrain.data.dataset import prepare_data
from test_parallel_cli import _corpus

pytestmark = pytest.mark.slow
STEPS, KILL_AFTER = 10, 3
LAYOUT = ["parallel.dp_shard=2"]  # FSDP2 ZeRO-3 on 2 ranks


def _train_args(tmp: Path, out: str) -> list[str]:
    return ["-m", "moetrain", "train", "--preset", "tiny", "--data", str(tmp / "corpus"), "--out", str(tmp / out),
            "--no-progress", f"data.cache_dir={tmp / 'cache'}", f"train.steps={STEPS}", "train.log_every=1",
            "train.eval_every=0", "train.ckpt_every=2", "train.eval_batches=1", "train.keep_checkpoints=2",
            "parallel.timeout_s=60", *LAYOUT]


def _torchrun(*agent: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *agent]


# The victim stops itself at the start of its optimizer step KILL_AFTER + 1 (after step KILL_AFTER), by SIGKILL
# (a rank dies) or SIGSTOP (its node is then killed from outside, agent included): a kill from outside timed by
# metrics.jsonl often landed after a 10-step job had finished on a loaded machine. Only a worker of the first start
# (TORCHELASTIC_RESTART_COUNT=0) with the chosen RANK ("any": every worker of this agent) stops; the agent (no RANK)
# and a rejoined node (no MOETRAIN_TEST_FAULT) are untouched.
INJECT = """import os
if os.environ.get("MOETRAIN_TEST_FAULT") and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and \\
        os.environ.get("MOETRAIN_TEST_FAULT_RANK") in (os.environ.get("RANK"), "any" if "RANK" in os.environ else ""):
    import signal
    import torch

    _step, _calls = torch.optim.AdamW.step, [0]

    def _faulty_step(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] > int(os.environ["MOETRAIN_TEST_FAULT_AFTER"]):
            os.kill(os.getpid(), getattr(signal, os.environ["MOETRAIN_TEST_FAULT"]))
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = _faulty_step
"""


def _start(cmd: list[str], log: Path, fault: tuple[str, str] | None = None, env: dict[str, str] | None = None
           ) -> subprocess.Popen:
    """Start ``cmd`` in a new session (the agent and its workers form one process group, killed together as a
    "node"); ``fault``: (signal name, rank) that this worker of the first start sends itself after step
    :data:`KILL_AFTER`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if fault is not None:
        inject = log.parent / "inject"
        inject.mkdir(exist_ok=True)
        (inject / "sitecustomize.py").write_text(INJECT)
        env.update(PYTHONPATH=os.pathsep.join([str(inject), *filter(None, [env.get("PYTHONPATH")])]),
                   MOETRAIN_TEST_FAULT=fault[0], MOETRAIN_TEST_FAULT_RANK=fault[1],
                   MOETRAIN_TEST_FAULT_AFTER=str(KILL_AFTER))
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _stopped_worker(agent_pid: int) -> bool:
    """Whether a worker under torchrun's agent ``agent_pid`` is stopped (SIGSTOP)."""
    import psutil

    try:
        return any(c.status() == psutil.STATUS_STOPPED for c in psutil.Process(agent_pid).children(recursive=True))
    except psutil.Error:
        return False


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait(proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"timed out: {log.read_text()[-3000:]}") from None
    assert proc.returncode == 0, log.read_text()[-4000:]


def _final_state(run: Path) -> dict:
    """The last checkpoint (DCP) of ``run`` as one process's state dict: model and optimizer, every tensor."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert int(last.name.removeprefix("step_")) == STEPS, last
    dcp_to_torch_save(last, run / "final.pt")
    return torch.load(run / "final.pt", weights_only=False)


def _flat(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}/{i}").items()}
    return {}


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in _records(run) if "train_loss" in r}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("elastic")
    _corpus(tmp / "corpus")
    cfg = build_config("tiny", overrides={"data": {"path": str(tmp / "corpus"), "cache_dir": str(tmp / "cache")}})
    prepare_data(cfg.data, cfg.model.vocab_size, log=lambda _: None)  # once, not by every job's rank 0
    one_node = ["--nproc_per_node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d"]

    # the uninterrupted run (one agent, 2 workers)
    port = free_port()
    log = tmp / "uninterrupted.log"
    _wait(_start(_torchrun(*one_node, "--rdzv-endpoint", f"127.0.0.1:{port}", *_train_args(tmp, "uninterrupted")),
                 log), log)

    # one rank killed after step 3; the agent restarts the group
    port = free_port()
    log = tmp / "restarted.log"
    agent = _start(_torchrun(*one_node, "--rdzv-endpoint", f"127.0.0.1:{port}", *_train_args(tmp, "restarted")), log,
                   fault=("SIGKILL", "1"))
    _wait(agent, log)
    return tmp


def test_restart_resumes_bit_exact(jobs):
    want, got = _flat(_final_state(jobs / "uninterrupted")), _flat(_final_state(jobs / "restarted"))
    assert want.keys() == got.keys() and len(want) > 10
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert _losses(jobs / "restarted") == _losses(jobs / "uninterrupted")
    assert sorted(_losses(jobs / "restarted")) == list(range(1, STEPS + 1))


def test_restart_is_recorded(jobs):
    events = [r for r in _records(jobs / "restarted") if r.get("event") == "resume"]
    assert len(events) == 1, events
    e = events[0]
    assert e["torchrun_restart"] == 1
    # rank 1 killed in step 4's optimizer step: the newest checkpoint is step 2's (ckpt_every=2); rank 0 logged step 3
    # and, as the AdamW step of a shard needs no peer, step 4 too, before step 4's checkpoint (a collective) failed
    assert e["resumed_from_step"] == 2 and e["last_logged_step"] in (3, 4)
    assert e["lost_steps"] == e["last_logged_step"] - 2
    log = (jobs / "restarted.log").read_text()
    assert "torchrun restart 1" in log and f"resumed at step {e['resumed_from_step']}" in log
    assert not any(r.get("event") for r in _records(jobs / "uninterrupted"))


def _node(tmp: Path, out: str, port: int, host: bool, log: Path, fault: tuple[str, str] | None = None,
          replaceable: bool = False) -> subprocess.Popen:
    """One "node": a torchrun agent with one worker in a 2-node c10d rendezvous at 127.0.0.1:``port``.
    ``replaceable``: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which (torch 2.13) a new agent joining a
    later round waits forever for the ``MASTER_ADDR`` that the surviving rank-0 agent writes only in its first."""
    agent = ["--nnodes", "2", "--nproc_per_node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", out,
             "--rdzv-conf", f"is_host={int(host)},join_timeout=180"]
    return _start(_torchrun(*agent, *_train_args(tmp, out), "--resume"), log, fault,
                  {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if replaceable else None)


@pytest.fixture(scope="module")
def nodes(jobs) -> Path:
    # two nodes, nothing lost
    port = free_port()
    a = _node(jobs, "two_nodes", port, True, jobs / "two_nodes_a.log")
    b = _node(jobs, "two_nodes", port, False, jobs / "two_nodes_b.log")
    _wait(a, jobs / "two_nodes_a.log")
    _wait(b, jobs / "two_nodes_b.log")

    # the node that does not host the rendezvous store is lost after step 3 (its worker stops itself, then the
    # node's agent and worker are killed); a new agent with the same command rejoins, and the host node's agent,
    # which restarted its own worker, meets it in the rendezvous
    port = free_port()
    a = _node(jobs, "node_lost", port, True, jobs / "node_lost_a.log", replaceable=True)
    b = _node(jobs, "node_lost", port, False, jobs / "node_lost_b.log", fault=("SIGSTOP", "any"), replaceable=True)
    deadline = time.monotonic() + 300
    while not _stopped_worker(b.pid):
        assert time.monotonic() < deadline and b.poll() is None, (jobs / "node_lost_b.log").read_text()[-3000:]
        time.sleep(0.02)
    import psutil

    workers = psutil.Process(b.pid).children(recursive=True)  # torchrun starts its workers in sessions of their own
    os.killpg(b.pid, signal.SIGKILL)
    for w in workers:  # the stopped worker too: a killpg of the agent's group leaves it behind
        try:
            w.kill()
        except psutil.Error:
            pass
    b.wait()
    b = _node(jobs, "node_lost", port, False, jobs / "node_lost_b2.log", replaceable=True)
    _wait(a, jobs / "node_lost_a.log")
    _wait(b, jobs / "node_lost_b2.log")
    return jobs


def test_two_nodes_train_as_one(nodes):
    assert _losses(nodes / "two_nodes") == _losses(nodes / "uninterrupted")
    want, got = _flat(_final_state(nodes / "uninterrupted")), _flat(_final_state(nodes / "two_nodes"))
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_a_lost_node_rejoins_and_the_run_ends_bit_exact(nodes):
    want, got = _flat(_final_state(nodes / "uninterrupted")), _flat(_final_state(nodes / "node_lost"))
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert _losses(nodes / "node_lost") == _losses(nodes / "uninterrupted")
    events = [r for r in _records(nodes / "node_lost") if r.get("event") == "resume"]
    assert len(events) == 1 and events[0]["lost_steps"] >= 1, events
