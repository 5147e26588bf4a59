"""Hot/cold expert store: decode tokens/s under ``--expert-memory-budget`` at 100%, 50% and 25% of the routed
experts' bytes, against the layers' own kernels with every expert resident (no store).

    python benchmarks/serve_experts.py RUN_OR_HF_DIR [--threads 1] [--seqs 16 1] [--tokens 48] [--repeat 3]

Each configuration loads the model afresh, builds the store (experts ranked by the run's routing statistics,
``--hot-share`` 0.5) and decodes ``--seqs`` sequences of ``--tokens`` tokens together through the engine (no HTTP;
temperature 0.8, seeds 0..N-1, so every configuration generates the same tokens), ``--repeat`` times (best kept: a
shared machine). Prints one JSON line per (batch, budget): tokens/s, page-ins per step, hit rate, peak resident
bytes (measured by the store after every page-in and every step).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch


def decode(served, n: int, tokens: int, store=None) -> tuple[float, list[list[int]], int]:
    from moetrain.model.sampling import SamplingParams
    from moetrain.serve.engine import Engine, GenRequest

    engine = Engine(served, num_slots=n, expert_store=store)
    engine.start()
    done = threading.Semaphore(0)
    reqs = [GenRequest(served.tokenizer.encode(f"def function_{i}(").ids, tokens,
                       lambda ev: ev.finish_reason and done.release(), SamplingParams(0.8, 1.0), i) for i in range(n)]
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    for _ in reqs:
        done.acquire()
    dt = time.perf_counter() - t0
    engine.stop()
    return sum(len(r.out_ids) for r in reqs) / dt, [r.out_ids for r in reqs], engine.steps


def main() -> int:
    from moetrain.serve.expert_store import ExpertStore, routed_expert_bytes
    from moetrain.serve.expert_usage import served_usage
    from moetrain.serve.loader import load_served_model

    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seqs", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hot-share", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for n in args.seqs:
        served = load_served_model(args.model_dir)
        total = routed_expert_bytes(served.model)
        runs = [decode(served, n, args.tokens) for _ in range(args.repeat)]
        ref = runs[0][1]
        print(json.dumps({"seqs": n, "budget": "none (layers' fused kernel)", "expert_bytes": total,
                          "decode_tokens_per_s": round(max(r[0] for r in runs), 1)}), flush=True)
        for frac in (1.0, 0.5, 0.25):
            served = load_served_model(args.model_dir)
            usage = served_usage(served)
            store = ExpertStore(served.model, int(total * frac), usage, served.experts_file(),
                                hot_share=args.hot_share)
            runs = [decode(served, n, args.tokens, store) for _ in range(args.repeat)]
            steps = sum(r[2] for r in runs)
            s = store.stats
            print(json.dumps({"seqs": n, "budget": f"{frac:.0%}", "budget_bytes": int(total * frac),
                              "usage": usage.source, "decode_tokens_per_s": round(max(r[0] for r in runs), 1),
                              "same_tokens": all(r[1] == ref for r in runs),
                              "pageins_per_step": round(s.misses / steps, 2),
                              "hit_rate": round(s.hits / max(1, s.hits + s.misses), 3),
                              "peak_resident_bytes": s.peak_bytes}), flush=True)
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
