"""Expert-parallel serving (moetrain/serve/expert_parallel.py): ``torchrun --nproc_per_node 2 -m moetrain serve RUN
parallel.ep=2`` (gloo, two processes, experts sharded 2 + 2 per layer, the all-to-all dispatcher) answers over HTTP
exactly what the single-process server answers: greedy completions of concurrent requests, a threshold-policy
request (a variable number of experts per token) and a seeded sampled one; it stays up while idle for longer than
``parallel.timeout_s`` (rank 0's heartbeats); and the flags are checked."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import subprocess
import sys
import time
from argparse import Namespace

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from _parallel_util import free_port  # noqa: E402
from _serve_util import start_server, train_tiny  # noqa: E402

from moetrain.errors import MoetrainError  # noqa: E402
from moetrain.serve.loader import load_served_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["ROMEO:", "The king is", "Speak, friend, and", "O night, sweet night", "What light"]
BODIES = [{"prompt": p, "max_tokens": 20, "temperature": 0} for p in PROMPTS] + [
    {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0,
     "routing": {"policy": "threshold", "p": 0.6, "k_min": 1, "k_max": 3}},
    {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0.9, "seed": 5},
]


def _answers(url: str) -> list[list[int]]:
    def one(body):
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/v1/completions", json={**body, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

    with cf.ThreadPoolExecutor(len(BODIES)) as pool:  # concurrent: steps batch several sequences
        return list(pool.map(one, BODIES))


def _start_ep2(run, tmp_path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "ep2.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "-m", "moetrain", "serve", str(run), "--port", "0", "--threads", "1",
         "--cache", "off", "--log-level", "warning", "parallel.ep=2", "parallel.timeout_s=4"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = (tmp_path / "ep2.log").read_text()
        m = re.search(r"running on (http://\S+)", text)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the EP server did not start:\n" + (tmp_path / "ep2.log").read_text()[-4000:])


def test_two_process_ep_server_equals_one_process(tmp_path):
    run = train_tiny(tmp_path)
    srv, _ = start_server(load_served_model(str(run)), num_slots=8)
    try:
        reference = _answers(srv.url)
    finally:
        srv.stop()
    proc, url = _start_ep2(run, tmp_path)
    try:
        assert "experts over 2 processes" in (tmp_path / "ep2.log").read_text()
        assert _answers(url) == reference
        time.sleep(6)  # idle longer than parallel.timeout_s=4: only the heartbeats keep rank 1's broadcast alive
        assert _answers(url) == reference
        assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Timed out" not in (tmp_path / "ep2.log").read_text()


def test_parallel_overrides_are_checked(monkeypatch):
    from moetrain.commands.serve import expert_parallel_mesh
    from moetrain.serve.expert_parallel import parallel_config

    assert parallel_config(["parallel.ep=2", "parallel.timeout_s=30"]).ep == 2
    with pytest.raises(MoetrainError, match="train.lr: serve takes only parallel.ep"):
        parallel_config(["train.lr=1"])
    with pytest.raises(MoetrainError, match="parallel.dp_shard: serve takes only"):
        parallel_config(["parallel.dp_shard=2"])
    with pytest.raises(MoetrainError, match="ep"):
        parallel_config(["parallel.ep=0"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert expert_parallel_mesh(Namespace(overrides=[], expert_memory_budget=None)) is None
    with pytest.raises(MoetrainError, match="parallel.ep: serve needs one process per EP rank; ep=2 but WORLD_SIZE=1"):
        expert_parallel_mesh(Namespace(overrides=["parallel.ep=2"], expert_memory_budget=None))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MoetrainError, match="--expert-memory-budget: not available with parallel.ep > 1"):
        expert_parallel_mesh(Namespace(overrides=["parallel.ep=2"], expert_memory_budget="1M"))
