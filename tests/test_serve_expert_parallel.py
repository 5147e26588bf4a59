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

import json  # noqa: E402

import torch  # noqa: E402
from _parallel_util import free_port, spawn  # noqa: E402
from _serve_util import start_server, train_tiny  # noqa: E402

from moetrain.cli import main  # noqa: E402
from moetrain.errors import MoetrainError  # noqa: E402
from moetrain.serve.expert_parallel import physical_ids  # noqa: E402
from moetrain.serve.forward import StepBatch, StepRunner  # noqa: E402
from moetrain.model.attention import KVCache  # noqa: E402
from moetrain.serve.loader import load_served_model  # noqa: E402
from moetrain.serve.moe import StepPolicies  # noqa: E402
from moetrain.serve.placement import load_placement  # noqa: E402
from moetrain.serve.routing import RoutingPolicy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["ROMEO:", "The king is", "Speak, friend, and", "O night, sweet night", "What light"]
BODIES = [{"prompt": p, "max_tokens": 20, "temperature": 0} for p in PROMPTS] + [
    {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0,
     "routing": {"policy": "threshold", "p": 0.6, "k_min": 1, "k_max": 3}},
    {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0.9, "seed": 5},
]


# alone, every decode step has one token: rank 1's share of it is empty (its dispatch holds no tokens)
# (p = 0.5 with k_max = E = 4: some candidate is always unkept, so a keep mask always reaches the dispatcher)
ALONE = {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0,
         "routing": {"policy": "threshold", "p": 0.5, "k_max": 4}}


def _answers(url: str) -> list[list[int]]:
    """The token ids answered to every body of BODIES (concurrently), then to ALONE (by itself)."""
    def one(body):
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/v1/completions", json={**body, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

    with cf.ThreadPoolExecutor(len(BODIES)) as pool:  # concurrent: steps batch several sequences
        answers = list(pool.map(one, BODIES))
    return answers + [one(ALONE)]


def _start_ep2(run, tmp_path, *flags: str, cache: str = "off") -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log_file = tmp_path / "ep2.log"
    log = open(log_file, "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "-m", "moetrain", "serve", str(run), "--port", "0", "--threads", "1",
         "--cache", cache, "--log-level", "warning", *flags, "parallel.ep=2", "parallel.timeout_s=4"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = log_file.read_text()
        m = re.search(r"running on (http://\S+)", text)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the EP server did not start:\n" + log_file.read_text()[-4000:])


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _one_process_answers(run) -> list:
    """The single-process server's answers to :func:`_answers`' requests (the reference of the EP servers)."""
    srv, _ = start_server(load_served_model(str(run)), num_slots=8)
    try:
        return _answers(srv.url)
    finally:
        srv.stop()


def test_two_process_ep_server_equals_one_process(tmp_path):
    run = train_tiny(tmp_path)
    reference = _one_process_answers(run)
    proc, url = _start_ep2(run, tmp_path)
    try:
        assert "experts over 2 processes" in (tmp_path / "ep2.log").read_text()
        assert _answers(url) == reference
        time.sleep(6)  # idle longer than parallel.timeout_s=4: only the heartbeats keep rank 1's broadcast alive
        assert _answers(url) == reference
        assert proc.poll() is None
    finally:
        _stop(proc)
    assert "Timed out" not in (tmp_path / "ep2.log").read_text()


def _step_logits(served, policy: RoutingPolicy) -> list[torch.Tensor]:
    """Logits [B, V] of a prefill of three prompts, then 3 decode steps feeding back the greedy tokens."""
    cfg = served.model.config
    runner = StepRunner(served.model, KVCache(cfg.n_layers, 3, cfg.max_seq_len))
    seqs = [(i, 0, served.tokenizer.encode(p).ids) for i, p in enumerate(PROMPTS[:3])]
    out = []
    for _ in range(4):
        batch = StepBatch.build(seqs)
        logits, _ = runner.step(batch, StepPolicies(((policy, int(batch.input_ids.numel())),)))
        out.append(logits)
        seqs = [(slot, start + len(toks), [t]) for (slot, start, toks), t in zip(seqs, logits.argmax(-1).tolist())]
    return out


POLICIES = [RoutingPolicy(), RoutingPolicy(policy="threshold", p=0.6, k_min=1, k_max=3)]


def _placed_rank(rank, world, out_dir, run: str, placement_file: str | None):
    from _parallel_util import ep_mesh
    from moetrain.serve.expert_parallel import shard_for_serving
    from moetrain.serve.placement import load_placement

    torch.set_grad_enabled(False)
    mesh = ep_mesh(world)
    served = load_served_model(run)
    placement = None if placement_file is None else load_placement(placement_file, [0, 1], 4, world)
    shard_for_serving(served.model, mesh, placement)
    held = [int(b.ffn.experts.num_experts) for b in served.model.blocks]
    rows = [torch.zeros(n, dtype=torch.int64) for n in held]  # rows each local physical expert computed

    def count(r: torch.Tensor):
        def hook(_module, args) -> None:  # args: (rows, tokens_per_expert)
            r.add_(args[1])
        return hook

    for b, r in zip(served.model.blocks, rows):
        b.ffn.experts.register_forward_pre_hook(count(r))
    return held, [_step_logits(served, pol) for pol in POLICIES], [r.tolist() for r in rows]


def test_physical_ids_spread_a_replicated_expert_over_its_replicas():
    # expert 0 has replicas at physical 0, 2 and 3; experts 1 and 2 one each (physical 1 and 4)
    table = torch.tensor([[0, 2, 3], [1, 1, 1], [4, 4, 4]])
    reps = torch.tensor([3, 1, 1])
    ids = torch.tensor([[0, 1], [0, 2], [2, 0], [0, 1], [1, 2]])  # token t: its 2 experts; expert 0 -> replica t % 3
    assert physical_ids(ids, table, reps).tolist() == [[0, 1], [2, 4], [4, 3], [0, 1], [1, 4]]


def test_placement_with_replicas_gives_the_single_process_logits(tmp_path):
    """Two forked gloo ranks with a placement of 4 + 2 physical experts (hot ones replicated, 3 per rank) and with a
    hand-made permutation (experts 3, 0 on rank 0; 1, 2 on rank 1) compute the single process's logits (fp32; only
    the order of the experts' sums differs), under the trained k and under a threshold policy."""
    run = train_tiny(tmp_path)
    reference = [_step_logits(load_served_model(str(run)), pol) for pol in POLICIES]
    assert main(["placement", str(run), "--ep", "2", "--redundant", "2", "--out", str(tmp_path / "pl")]) == 0
    replicated = tmp_path / "pl" / "placement-ep2-r2.json"
    d = json.loads(replicated.read_text())
    assert all(max(lay["replicas"]) > 1 for lay in d["layers"].values())
    for lay in d["layers"].values():
        lay["physical_to_logical"], lay["replicas"] = [3, 0, 1, 2], [1, 1, 1, 1]
    d["redundant"] = 0
    permuted = tmp_path / "pl" / "permuted.json"
    permuted.write_text(json.dumps(d))
    for f, held in ((replicated, 3), (permuted, 2)):
        for rank_held, logits, rows in spawn(_placed_rank, 2, tmp_path / f.stem, str(run), str(f)):
            assert rank_held == [held, held]
            assert all(n > 0 for layer in rows for n in layer), rows  # every replica takes its share of tokens
            for got, want in zip(logits, reference):
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_two_process_ep_server_with_a_placement_equals_one_process(tmp_path):
    """``torchrun ... serve RUN --placement placement-ep2-r2.json parallel.ep=2`` (hot experts replicated), with the
    default response cache on, answers what one process answers, twice (the second time from the cache); a
    placement for another ep or without parallel.ep is refused naming the file."""
    run = train_tiny(tmp_path)
    reference = _one_process_answers(run)
    assert main(["placement", str(run), "--ep", "2", "--redundant", "2"]) == 0
    placement = run / "placement-ep2-r2.json"
    proc, url = _start_ep2(run, tmp_path, "--placement", str(placement), cache="memory")
    try:
        assert f"placed by {placement}" in (tmp_path / "ep2.log").read_text()
        assert _answers(url) == reference
        assert _answers(url) == reference
        assert proc.poll() is None
    finally:
        _stop(proc)


def test_placement_flag_is_checked(tmp_path, capsys):
    run = train_tiny(tmp_path)
    assert main(["placement", str(run), "--ep", "2", "--redundant", "2"]) == 0
    f = run / "placement-ep2-r2.json"
    capsys.readouterr()
    assert main(["serve", str(run), "--placement", str(f), "--port", "0"]) == 2
    assert f"--placement: {f} places experts over EP ranks; serve it with torchrun" in capsys.readouterr().err
    with pytest.raises(MoetrainError, match="ep: the placement is for 2 ranks, but serving runs 4"):
        load_placement(f, [0, 1], 4, ep=4)


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
