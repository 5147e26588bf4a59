"""Dynamic top-k trade-off: validation loss and decode tokens/s against mean active experts per token.

    python benchmarks/serve_topk.py RUN_OR_HF_DIR [--val-tokens 8192] [--threads 1]

Policies: fixed k = 1, 2 (and the trained k) and threshold p in {0.5, 0.7, 0.9} (k_min 1, k_max = the trained k + 1,
capped at E). Loss: next-token cross-entropy on held-out text (the end of ../shared/data/tinyshakespeare.txt, or
--text FILE) through the serving forward with the policy. Decode tokens/s: 16 sequences decoded together by the
engine (no HTTP), 32 tokens each. Also ``load`` under a burst: the k per step as 48 requests arrive and drain.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> int:
    from moetrain.serve.engine import Engine, GenRequest
    from moetrain.serve.forward import StepBatch, StepRunner
    from moetrain.serve.kv_cache import SlotKVCache
    from moetrain.serve.loader import load_served_model
    from moetrain.serve.moe import StepPolicies
    from moetrain.serve.routing import RoutingPolicy

    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--val-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" /
                                          "tinyshakespeare.txt"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sm = load_served_model(args.model_dir)
    cfg, c = sm.model.config, sm.model.moe_layers()[0].config
    k, e = c.top_k, c.num_experts
    ids = sm.tokenizer.encode(Path(args.text).read_text()[-200_000:]).ids[-args.val_tokens:]
    seq = min(cfg.max_seq_len, 256)
    chunks = [ids[i:i + seq] for i in range(0, len(ids) - seq + 1, seq)]
    policies = [RoutingPolicy(policy="fixed", k=1), RoutingPolicy(policy="fixed", k=min(2, e))]
    policies += [RoutingPolicy(policy="threshold", p=p, k_min=1, k_max=min(k + 1, e)) for p in (0.5, 0.7, 0.9)]
    rows = []
    for policy in policies:
        runner = StepRunner(sm.model, SlotKVCache(1, cfg.n_layers, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_size))
        nll, n, active = 0.0, 0, 0
        for chunk in chunks:
            batch = StepBatch.build([(0, 0, chunk)])
            logits, stats = runner.step(batch, StepPolicies(((policy, len(chunk)),)), all_logits=True)
            nll += float(F.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum"))
            n += len(chunk) - 1
            active += sum(s.active for s in stats) / len(stats)
        tps = decode_tps(sm, policy, Engine, GenRequest)
        rows.append({"policy": policy.policy, "k": policy.k, "p": policy.p if policy.policy == "threshold" else None,
                     "mean_active_experts": round(active / sum(len(ch) for ch in chunks), 3),
                     "val_loss": round(nll / n, 4), "decode_tokens_per_s": round(tps, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"load_burst_k_per_step": load_burst(sm, k, e, Engine, GenRequest, RoutingPolicy)}))
    return 0


def decode_tps(sm, policy, Engine, GenRequest, n: int = 16, tokens: int = 32) -> float:
    engine = Engine(sm, num_slots=n, policy=policy)
    engine.start()
    done = threading.Semaphore(0)
    reqs = [GenRequest(sm.tokenizer.encode(f"ROMEO {i}:").ids, tokens, lambda ev: ev.finish_reason and done.release(),
                       0.8, 1.0, i) for i in range(n)]
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    for _ in reqs:
        done.acquire()
    dt = time.perf_counter() - t0
    engine.stop()
    return sum(len(r.out_ids) for r in reqs) / dt


def load_burst(sm, k, e, Engine, GenRequest, RoutingPolicy) -> list[int]:
    """k chosen per step by the load policy (k_min 1, k_max K, low 4, high 24) while 48 requests arrive at once
    into 8 slots and drain."""
    engine = Engine(sm, num_slots=8, policy=RoutingPolicy(policy="load", k_min=1, k_max=k, low=4, high=24))
    seen: list[int] = []
    set_k = engine.metrics.load_top_k.set
    engine.metrics.load_top_k.set = lambda v: (seen.append(int(v)), set_k(v))
    engine.start()
    done = threading.Semaphore(0)
    reqs = [GenRequest(sm.tokenizer.encode(f"Line {i}:").ids, 12, lambda ev: ev.finish_reason and done.release())
            for i in range(48)]
    for r in reqs:
        engine.submit(r)
    for _ in reqs:
        done.acquire()
    engine.stop()
    return seen


if __name__ == "__main__":
    sys.exit(main())
