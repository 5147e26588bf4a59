"""Bounded load test of ``moetrain serve`` (at most ~60 s): sequential vs concurrent clients.

    python benchmarks/serve_load.py RUN_OR_HF_DIR [--clients 16] [--requests 3] [--max-tokens 32] [--threads 1]
    python benchmarks/serve_load.py --train-tiny      # trains a tiny run in a temporary directory first

Starts the server as a subprocess on 127.0.0.1 port 0 (response cache off, so every request is generated), then:
1. sequential serving: one client sends ``clients`` requests one after another;
2. concurrent serving: ``clients`` clients send ``requests`` requests each at once.
Prints aggregate generated tokens/s of both and their ratio, p50/p99 request latency under concurrency, and the
server's resident memory (VmRSS) after a warm-up request and after the load. Extra server flags follow ``--``
(e.g. ``-- --routing threshold --threshold 0.7``). Nothing is asserted; the figures go to docs/serving.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

DEADLINE_S = 60.0
PROMPTS = ["ROMEO:", "The king is", "Speak, friend, and", "O night, sweet night", "First Citizen:", "What say you"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(model_dir: str, threads: int, slots: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "moetrain", "serve", model_dir, "--port", "0", "--cache", "off",
                             "--threads", str(threads), "--slots", str(slots), "--log-level", "warning",
                             *extra],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        m = re.search(r"running on (http://\S+:\d+)", line)
        if m:  # keep draining stderr, so a full pipe never blocks the server
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit("server did not start")


def one(url: str, i: int, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": max_tokens,
                                            "temperature": 0.8, "seed": i})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"], time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--train-tiny", action="store_true")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3, help="requests per client in the concurrent phase")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args, extra = ap.parse_known_args()
    extra = [e for e in extra if e != "--"]
    start_t = time.monotonic()
    model_dir = args.model_dir
    if args.train_tiny:
        tmp = Path(tempfile.mkdtemp(prefix="serve_load_"))
        corpus = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
        subprocess.run([sys.executable, "-m", "moetrain", "train", "--preset", "tiny", "--data", str(corpus),
                        "--out", str(tmp / "run"), "--no-progress", "train.threads=1"], check=True,
                       stdout=subprocess.DEVNULL)
        model_dir = str(tmp / "run")
    if model_dir is None:
        ap.error("give a model directory or --train-tiny")
    proc, url = start(model_dir, args.threads, args.clients, extra)
    try:
        one(url, 999, 4)  # warm-up
        rss_before = rss_mib(proc.pid)
        t0 = time.perf_counter()
        seq = [one(url, i, args.max_tokens) for i in range(args.clients)]
        seq_s = time.perf_counter() - t0
        n = args.clients * args.requests
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(args.clients) as pool:
            conc = list(pool.map(lambda i: one(url, 1000 + i, args.max_tokens), range(n)))
        conc_s = time.perf_counter() - t0
        rss_after = rss_mib(proc.pid)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lat = sorted(t for _, t in conc)
    seq_tps = sum(k for k, _ in seq) / seq_s
    conc_tps = sum(k for k, _ in conc) / conc_s
    batch = re.search(r"^moetrain_batch_size_sum (\S+)$", metrics, re.M), re.search(
        r"^moetrain_batch_size_count (\S+)$", metrics, re.M)
    out = {
        "sequential_tokens_per_s": round(seq_tps, 1), "concurrent_tokens_per_s": round(conc_tps, 1),
        "speedup": round(conc_tps / seq_tps, 2), "clients": args.clients, "requests": n,
        "p50_latency_s": round(statistics.median(lat), 3), "p99_latency_s": round(lat[min(len(lat) - 1,
                                                                                          int(0.99 * len(lat)))], 3),
        "mean_batch_size": round(float(batch[0].group(1)) / float(batch[1].group(1)), 2),
        "rss_before_mib": round(rss_before, 1), "rss_after_mib": round(rss_after, 1),
        "rss_change": f"{100 * (rss_after - rss_before) / rss_before:+.1f}%",
        "wall_s": round(time.monotonic() - start_t, 1), "server_flags": extra,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if out["wall_s"] > DEADLINE_S:
        print(f"warning: ran {out['wall_s']} s, over the {DEADLINE_S} s budget; lower --requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
