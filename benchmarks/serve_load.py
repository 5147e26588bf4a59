"""Bounded load test of ``moetrain serve`` (at most ``--deadline`` = 60 s of requests): sequential vs concurrent
clients.

    python benchmarks/serve_load.py RUN_OR_HF_DIR [--clients 16] [--requests 3] [--max-tokens 32] [--threads 1]
    python benchmarks/serve_load.py --train-tiny      # trains a tiny run in a temporary directory first

Starts the server as a subprocess on 127.0.0.1 port 0 (response cache off, so every request is generated), then,
within one deadline counted from the warm-up request (server start-up and training are not counted), ``--rounds``
times (each round gets an equal share of the time left; alternating, so a load that drifts on a shared machine
weighs on both phases alike):

1. sequential serving: one client sends ``clients`` requests one after another (until 40% of the round's share);
2. concurrent serving: ``clients`` clients send ``requests`` requests each at once (until the round's end).

The clients are asyncio tasks in one thread, each with one kept-alive connection (``--client raw``: HTTP/1.1
written and parsed by hand, ~0.2 ms of CPU per request; ``--client httpx``: ``httpx.AsyncClient``, ~4 ms). The load
generator runs on the same cores as the server, so its own cost is kept low: 16 threads of ``httpx.Client``, as
this script used before 2026-12-01, cost ~9.5 ms of CPU per request, more than the server spends on it.

No request is sent after its phase's deadline and none is waited for past it (each is cancelled when its time is
up): the figures count completed requests only, and the report says how many of those sent completed. Prints the
generated tokens/s of both phases over all rounds and their ratio (and each round's), p50/p99 request latency under
concurrency, the engine's mean batch and busy share during the concurrent phases, the CPU seconds of the server
and of this client, and the server's resident memory (VmRSS) after a warm-up request and after the load. Extra
server flags follow ``--`` (e.g. ``-- --routing threshold --threshold 0.7``). Nothing is asserted; the figures go
to docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

DEADLINE_S = 60.0
PROMPTS = ["ROMEO:", "The king is", "Speak, friend, and", "O night, sweet night", "First Citizen:", "What say you"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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


class RawConnection:
    """One kept-alive HTTP/1.1 connection, requests written and responses parsed by hand (Content-Length bodies, and
    chunked ones for server-sent events)."""

    def __init__(self, url: str):
        host, _, port = url.split("//", 1)[1].partition(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes, int]:
        """(status, body bytes (empty for a chunked one), SSE ``data: {`` events seen)."""
        for attempt in (0, 1):  # the server may have closed an idle kept-alive connection: reconnect once
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                return await self._exchange(method, path, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                await self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _exchange(self, method: str, path: str, body: dict | None) -> tuple[int, bytes, int]:
        assert self.reader is not None and self.writer is not None
        data = json.dumps(body).encode() if body is not None else b""
        self.writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
        events = 0
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                chunk = (await self.reader.readexactly(size + 2))[:-2]
                if size == 0:
                    break
                events += chunk.count(b"data: {")  # the server writes whole events per chunk
            payload = b""
        else:
            payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            await self.close()
        return status, payload, events

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class HttpxConnection:
    """The same interface over ``httpx.AsyncClient`` (one connection)."""

    def __init__(self, url: str):
        import httpx

        self.client = httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=1))

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes, int]:
        events = 0
        async with self.client.stream(method, path, json=body) as r:
            if r.headers.get("transfer-encoding") == "chunked":
                async for line in r.aiter_lines():
                    events += line.startswith("data: {")
                return r.status_code, b"", events
            return r.status_code, await r.aread(), 0

    async def close(self) -> None:
        await self.client.aclose()


class Load:
    """Requests bounded by deadlines (``time.monotonic()`` seconds); counts what was sent, completed, cut off."""

    def __init__(self, url: str, max_tokens: int, stream: bool, kind: str):
        self.url, self.max_tokens, self.stream, self.kind = url, max_tokens, stream, kind
        self.sent = self.completed = self.late = 0

    def connection(self):
        return RawConnection(self.url) if self.kind == "raw" else HttpxConnection(self.url)

    async def send(self, conn, i: int, deadline: float) -> tuple[int, float] | None:
        """One completion: (generated tokens, latency s), or ``None`` when the deadline passed first."""
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        self.sent += 1
        body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": self.max_tokens, "temperature": 0.8,
                "seed": i, "stream": self.stream}
        t0 = time.perf_counter()
        try:
            status, payload, events = await asyncio.wait_for(conn.request("POST", "/v1/completions", body), left)
        except asyncio.TimeoutError:
            self.late += 1
            await conn.close()  # its answer is still coming: the connection cannot be reused
            return None
        if status != 200:
            raise SystemExit(f"HTTP {status}: {payload[:300]!r}")
        self.completed += 1
        tokens = events if self.stream else json.loads(payload)["usage"]["completion_tokens"]
        return tokens, time.perf_counter() - t0

    async def phase(self, n_clients: int, per_client: int, first: int, deadline: float
                    ) -> tuple[list[tuple[int, float]], float]:
        """``n_clients`` clients, each sending ``per_client`` requests one after another until ``deadline``: the
        completed (tokens, latency) and the phase's wall seconds."""

        async def client(k: int) -> list[tuple[int, float]]:
            conn, out = self.connection(), []
            try:
                for j in range(per_client):
                    got = await self.send(conn, first + k * per_client + j, deadline)
                    if got is None:
                        break
                    out.append(got)
            finally:
                await conn.close()
            return out

        t0 = time.perf_counter()
        done = await asyncio.gather(*(client(k) for k in range(n_clients)))
        return [x for xs in done for x in xs], time.perf_counter() - t0

    async def step_metrics(self) -> tuple[float, float, float]:
        """The server's (sequences stepped, engine steps, seconds in steps) so far, from /metrics."""
        conn = RawConnection(self.url)
        try:
            _, text, _ = await conn.request("GET", "/metrics")
        finally:
            await conn.close()
        got = [re.search(rf"^moetrain_{k} (\S+)$", text.decode(), re.M)
               for k in ("batch_size_sum", "batch_size_count", "step_seconds_sum")]
        return tuple(float(m.group(1)) if m else float("nan") for m in got)  # type: ignore[return-value]


async def measure(load: Load, args, pid: int) -> dict:
    end = time.monotonic() + args.deadline
    conn = load.connection()
    warm = await load.send(conn, 999, end)
    await conn.close()
    if warm is None:
        raise SystemExit("the warm-up request did not complete within the deadline")
    out: dict = {"rss_before": rss_mib(pid), "seq": [], "conc": [], "seq_s": 0.0, "conc_s": 0.0, "rounds": [],
                 "seqs": 0.0, "steps": 0.0, "step_s": 0.0, "seq_sent": 0, "conc_sent": 0,
                 "server_cpu": 0.0, "client_cpu": 0.0}
    for k in range(args.rounds):  # alternating phases: the machine's load drifts alike over both
        now = time.monotonic()
        budget = (end - now) / (args.rounds - k)
        sent = load.sent
        s_done, s_s = await load.phase(1, args.clients, 100 * k, now + 0.4 * budget)
        out["seq_sent"] += load.sent - sent
        m0, sent, cpu0, own0 = await load.step_metrics(), load.sent, cpu_s(pid), own_cpu_s()
        c_done, c_s = await load.phase(args.clients, args.requests, 10_000 + 1000 * k, now + budget)
        out["server_cpu"] += cpu_s(pid) - cpu0
        out["client_cpu"] += own_cpu_s() - own0
        m1 = await load.step_metrics()
        out["conc_sent"] += load.sent - sent
        for key, a, b in zip(("seqs", "steps", "step_s"), m0, m1):
            out[key] += b - a
        out["seq"] += s_done
        out["conc"] += c_done
        out["seq_s"] += s_s
        out["conc_s"] += c_s
        if s_done and c_done:
            out["rounds"].append(round((sum(t for t, _ in c_done) / c_s) / (sum(t for t, _ in s_done) / s_s), 2))
    out["rss_after"] = rss_mib(pid)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--train-tiny", action="store_true")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3, help="requests per client in each concurrent phase")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stream", action="store_true", help="streaming requests (one SSE event per token)")
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw",
                    help="raw: hand-written HTTP/1.1 over asyncio streams; httpx: httpx.AsyncClient")
    ap.add_argument("--rounds", type=int, default=4,
                    help="sequential + concurrent phase pairs, alternating, each given an equal share of the deadline")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help="seconds for all rounds together, from the warm-up request (60 by default)")
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
    load = Load(url, args.max_tokens, args.stream, args.client)
    load_t0 = time.monotonic()
    try:
        r = asyncio.run(measure(load, args, proc.pid))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    seq, conc = r["seq"], r["conc"]
    if not seq or not conc:
        raise SystemExit(f"no request completed in a phase (sequential {len(seq)}, concurrent {len(conc)}); "
                         "raise --deadline or lower --max-tokens")
    lat = sorted(t for _, t in conc)
    seq_tps = sum(k for k, _ in seq) / r["seq_s"]
    conc_tps = sum(k for k, _ in conc) / r["conc_s"]
    n_conc = len(conc)
    out = {
        "sequential_tokens_per_s": round(seq_tps, 1), "concurrent_tokens_per_s": round(conc_tps, 1),
        "speedup": round(conc_tps / seq_tps, 2), "speedup_per_round": r["rounds"],
        "clients": args.clients, "stream": args.stream, "client": args.client,
        "sequential_completed": f"{len(seq)} of {r['seq_sent']} sent ({args.rounds * args.clients} planned)",
        "concurrent_completed": f"{n_conc} of {r['conc_sent']} sent "
                                f"({args.rounds * args.clients * args.requests} planned)",
        "cut_off_at_deadline": load.late,
        "p50_latency_s": round(statistics.median(lat), 3),
        "p99_latency_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
        "concurrent_engine_steps": int(r["steps"]),
        "concurrent_mean_batch_size": round(r["seqs"] / max(r["steps"], 1), 2),
        "concurrent_engine_busy": f"{100 * r['step_s'] / r['conc_s']:.0f}%",
        "concurrent_cpu_ms_per_request": {"server": round(1000 * r["server_cpu"] / n_conc, 2),
                                          "client": round(1000 * r["client_cpu"] / n_conc, 2)},
        "rss_before_mib": round(r["rss_before"], 1), "rss_after_mib": round(r["rss_after"], 1),
        "rss_change": f"{100 * (r['rss_after'] - r['rss_before']) / r['rss_before']:+.1f}%",
        "load_s": round(time.monotonic() - load_t0, 1), "wall_s": round(time.monotonic() - start_t, 1),
        "server_flags": extra,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
