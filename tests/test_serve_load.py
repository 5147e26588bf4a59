"""`moetrain serve` under load at its default settings (the CLI's defaults: 16 slots, queue 64, the default
thread count, the response cache on): 64 concurrent clients, sampled and streamed requests mixed, zero errors, every
answer whole, and the server healthy afterwards. (Token for token equality with the request alone is
test_serve_api's, at one thread: with several, matrix products over batches of other sizes may round differently in
the last bits, and a sampled token at a near-tie can follow them.)"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from _serve_util import DEFAULT_THREADS, at_default_threads, train_tiny  # noqa: E402


CLIENTS, REQUESTS, TOKENS = 64, 2, 6
# prompts of some length: steps that prefill many tokens at once take the fused MoE path's multi-threaded branch
PROMPTS = ["def x(self, y):\n    return self.z(w)", "ROMEO: But soft, what light through yonder window breaks?",
           "First Citizen: Before we proceed any further, hear me speak."]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = train_tiny(tmp_path_factory.mktemp("serve_load"))
    at_default_threads()  # the in-process training left one thread; serving runs at the default
    return run


@pytest.mark.parametrize("threads", [None, DEFAULT_THREADS], ids=["default", "torch-default"])
def test_sixty_four_clients_at_default_settings(run_dir, threads):
    """At the CLI's defaults, and at PyTorch's own thread count (several where the machine has them: the fused MoE
    path's multi-threaded branch, which the serving default leaves on a 2-core machine)."""
    import argparse

    from moetrain.commands import serve as serve_cmd
    from moetrain.runtime.threads import serving_threads
    from moetrain.serve.server import BackgroundServer

    if threads is not None and threads == serving_threads():
        pytest.skip(f"PyTorch's default of {threads} threads is the serving default here")
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    flags = [] if threads is None else ["--threads", str(threads)]
    args = parser.parse_args(["serve", str(run_dir), "--port", "0", *flags])
    want = serving_threads() if threads is None else threads
    app, engine = serve_cmd.build_app(args)
    assert engine.threads == want and engine.num_slots == 16 and engine.max_queue == 64
    srv = BackgroundServer(app, limits=serve_cmd.limits_from_args(args)).start()
    sm = engine.served

    def body(k: int) -> dict:  # a seed per request: no cache hits
        return {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": TOKENS, "temperature": 0.8, "seed": k,
                "stream": k % 2 == 1, "return_token_ids": True}

    async def client(c: httpx.AsyncClient, i: int) -> list[tuple[int, list[int]]]:
        out = []
        for j in range(REQUESTS):
            k = i * REQUESTS + j
            if body(k)["stream"]:
                ids: list[int] = []
                async with c.stream("POST", "/v1/completions", json=body(k)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            ids += chunk["choices"][0]["token_ids"] if "choices" in chunk else [-1]
                    out.append((r.status_code, ids))
            else:
                r = await c.post("/v1/completions", json=body(k))
                out.append((r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text))
        return out

    async def load():
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as c:
            return await asyncio.gather(*(client(c, i) for i in range(CLIENTS)))

    try:
        results = asyncio.run(load())
        flat = [(i * REQUESTS + j, got) for i, rs in enumerate(results) for j, got in enumerate(rs)]
        errors = [(k, status, ids) for k, (status, ids) in flat if status != 200]
        assert not errors, errors[:3]
        vocab = engine.vocab_size
        whole = [(k, ids) for k, (_, ids) in flat
                 if not (0 < len(ids) <= TOKENS and all(0 <= t < vocab for t in ids)
                         and (len(ids) == TOKENS or ids[-1] == sm.eos_id))]
        assert not whole, whole[:3]
        health = httpx.get(srv.url + "/health", timeout=30).json()
        assert health["status"] == "ok" and health["running"] == 0 and health["waiting"] == 0
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        outcomes = dict(re.findall(r'^moetrain_requests_total\{outcome="(\w+)"\} (\S+)$', metrics, re.M))
        assert outcomes == {"ok": f"{float(CLIENTS * REQUESTS)}"}, outcomes
        assert "moetrain_cache_hits_total 0.0" in metrics
        assert engine.occupancy() == (0, 0)  # every slot free once every answer is in
    finally:
        srv.stop()
        engine.stop()
        at_default_threads()
