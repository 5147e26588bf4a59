"""Load test of ``moetrain serve``: many concurrent clients against several server configurations, alternating
rounds, with p50 / p99 request latency and generated tokens/s for each.

    python benchmarks/serve_load.py RUN_DIR [--clients 64] [--requests 4] [--max-tokens 32] [--rounds 5]
    python benchmarks/serve_load.py --train [--preset cpu-small] [--steps 40]  # trains a run in a temporary dir first
    python benchmarks/serve_load.py RUN_DIR --peer          # also: 16 clients against transformers serve
    python benchmarks/serve_load.py RUN_DIR --peer-only     # only that

``--train`` trains the default job's model, what users serve (``moetrain train --preset cpu-small`` on ``--data``,
by default ``shared/data/tinyshakespeare.txt`` in a directory above the repository, for ``--steps`` optimizer steps:
the speed of serving does not depend on how well the model has learned); ``--train-tiny`` is ``--train --preset
tiny``. The record names the preset (read from the run's ``config.json``).

Comparisons (each a group of servers started as subprocesses on 127.0.0.1, port 0 or a free port, response cache
off so that every request is generated; the group's servers run side by side and take turns, round by round, so a
load that drifts on a shared machine weighs on all alike; with the per-round figures to show the spread):

1. ``--clients`` (64) concurrent clients: ``moetrain serve`` at its default settings (default thread count) vs
   ``--threads 1``;
2. with ``--peer``: ``--peer-clients`` (16) concurrent clients: ``moetrain serve`` at its defaults vs
   ``transformers serve --continuous-batching`` (CPU) on the same weights (``moetrain export RUN --format hf DIR``),
   the same client, prompts and request bodies (``POST /v1/completions`` with prompt, max_tokens and temperature
   0: transformers serve samples only where the model's generation config sets ``do_sample``, which an exported
   run's does not, so greedy is the work both do).

Each server is first warmed up with one round of the comparison's clients (not counted). Each round gives each
server ``--round-s`` seconds in turn (A B A B ..., each starting on an idle server: the next
waits until the last one has dropped what was cut off): its clients send ``--requests`` requests each, one after
another; no request is sent after the deadline and none is waited for past it (cut off: counted, not in the
figures). Tokens are the responses' ``usage.completion_tokens``. On a shared machine the rounds' speeds spread
widely: the figure to read is the median over rounds of the ratio of two servers' tokens/s in the same round.
Figures per server: completed / sent / failed requests (any status but 200 is a failure: the run reports it and
goes on), tokens/s over the rounds' wall time, p50 / p99 latency. The clients are asyncio tasks in one thread, each
with one kept-alive connection (``--client raw``: HTTP/1.1 written and parsed by hand, ~0.2 ms of CPU per request;
``--client httpx``: ``httpx.AsyncClient``). The load generator runs on the same cores as the servers.

The figures are printed and appended as one JSON record (date, CPU model, commit, command, figures) to
``results/<date>-serve-load.json`` (a list of records; ``--results DIR`` to write elsewhere, ``--no-record`` not at
all).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def x(self, y):\n    return self.z(w)", "ROMEO:", "The king is", "Speak, friend, and",
           "O night, sweet night", "First Citizen:", "What say you"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def model_preset(model_dir: str) -> str:
    """The preset a run was trained from (its ``config.json``), or ``unknown`` (an HF directory, no preset)."""
    try:
        return str(json.loads((Path(model_dir) / "config.json").read_text()).get("preset") or "unknown")
    except (OSError, ValueError, AttributeError):
        return "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server subprocess: ``name``, ``url``, and the ``model`` field its requests carry (``None``: omitted)."""

    def __init__(self, name: str, cmd: list[str], url: str | None = None, model: str | None = None,
                 env: dict | None = None):
        self.name, self.cmd, self.model = name, cmd, model
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.url = url or self._printed_url()
        self.log: collections.deque[str] = collections.deque(maxlen=20)  # stderr's last lines, for errors
        threading.Thread(target=self._drain, daemon=True).start()  # a full pipe never blocks it

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip())

    def _printed_url(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            m = re.search(r"running on (http://\S+:\d+)", line)
            if m:
                return m.group(1)
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise SystemExit(f"{self.name} did not start: {' '.join(self.cmd)}")

    async def wait_ready(self, path: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}): {' '.join(self.cmd)}\n"
                                 + "\n".join(self.log))
            conn = RawConnection(self.url)
            try:
                status, _, _ = await conn.request("GET", path)
                if status == 200:
                    return
            except OSError:
                pass
            finally:
                await conn.close()
            await asyncio.sleep(1.0)
        raise SystemExit(f"{self.name} not ready after {timeout:g} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def moetrain_server(name: str, model_dir: str, flags: list[str]) -> Server:
    return Server(name, [sys.executable, "-m", "moetrain", "serve", model_dir, "--port", "0", "--cache", "off",
                         "--log-level", "warning", *flags])


def transformers_server(hf_dir: str) -> Server:
    port = free_port()
    cmd = ["transformers", "serve", hf_dir, "--continuous-batching", "--device", "cpu", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]
    return Server("transformers serve --continuous-batching", cmd, f"http://127.0.0.1:{port}", model=hf_dir)


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
    """The clients of one server: requests bounded by deadlines (``time.monotonic()`` seconds)."""

    def __init__(self, server: Server, args, temperature: float):
        self.server, self.args, self.temperature = server, args, temperature
        self.sent = self.failed = self.late = 0
        self.done: list[tuple[int, float]] = []  # (completion tokens, latency s) of completed requests
        self.wall = 0.0
        self.failures: list[str] = []
        self.per_round: list[float] = []  # tokens/s of each round

    def connection(self):
        return RawConnection(self.server.url) if self.args.client == "raw" else HttpxConnection(self.server.url)

    async def send(self, conn, i: int, deadline: float) -> bool:
        """One completion; False when the deadline passed (before sending or while waiting)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self.sent += 1
        body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": self.args.max_tokens,
                "temperature": self.temperature}
        if self.server.model is not None:
            body["model"] = self.server.model
        t0 = time.perf_counter()
        try:
            status, payload, _ = await asyncio.wait_for(conn.request("POST", "/v1/completions", body), left)
        except asyncio.TimeoutError:
            self.late += 1
            await conn.close()  # its answer is still coming: the connection cannot be reused
            return False
        except (OSError, asyncio.IncompleteReadError) as e:
            self.failed += 1
            self.failures.append(repr(e)[:200])
            await conn.close()
            return True
        if status != 200:
            self.failed += 1
            self.failures.append(f"HTTP {status}: {payload[:200]!r}")
            return True
        self.done.append((json.loads(payload)["usage"]["completion_tokens"], time.perf_counter() - t0))
        return True

    async def round(self, n_clients: int, first: int, deadline: float) -> None:
        async def client(k: int) -> None:
            conn = self.connection()
            try:
                for j in range(self.args.requests):
                    if not await self.send(conn, first + k * self.args.requests + j, deadline):
                        break
            finally:
                await conn.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(n_clients)))
        self.wall += time.perf_counter() - t0

    def figures(self) -> dict:
        lat = sorted(t for _, t in self.done)
        tokens = sum(k for k, _ in self.done)
        return {"completed": len(self.done), "sent": self.sent, "failed": self.failed, "cut_off": self.late,
                "tokens_per_s": round(tokens / self.wall, 1) if self.wall else None,
                "p50_latency_s": round(statistics.median(lat), 3) if lat else None,
                "p99_latency_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
                "mean_tokens_per_request": round(tokens / len(self.done), 1) if self.done else None,
                "tokens_per_s_per_round": self.per_round,
                "first_failures": self.failures[:3]}


async def compare(servers: list[Server], n_clients: int, args, temperature: float) -> dict:
    """Alternating rounds of ``n_clients`` clients against each server; figures per server name."""
    for s in servers:
        await s.wait_ready("/v1/models")
        warm = Load(s, args, temperature)
        # a whole round of the comparison's clients: allocations, thread pools and the batch shapes of this load
        # (transformers serve's first rounds at 16 clients ran at 1/3 of its later speed after a 2-client warm-up)
        await warm.round(n_clients, 99_000, time.monotonic() + 120)
        if warm.failed:
            raise SystemExit(f"{s.name}: warm-up failed: {warm.failures[:2]}")
    loads = [Load(s, args, temperature) for s in servers]
    for r in range(args.rounds):
        for load in loads:  # A B A B ...: never one server's rounds back to back
            tokens, wall = sum(k for k, _ in load.done), load.wall
            await load.round(n_clients, 1000 * r, time.monotonic() + args.round_s)
            load.per_round.append(round((sum(k for k, _ in load.done) - tokens) / (load.wall - wall), 1))
            await drained(load.server)
    out = {load.server.name: load.figures() for load in loads}
    a, b = loads[0].per_round, loads[1].per_round
    ratios = [round(x / y, 2) for x, y in zip(a, b) if y > 0]
    key = f"tokens_per_s_ratio ({loads[0].server.name} / {loads[1].server.name})"
    out[key] = {"per_round": ratios, "median": round(statistics.median(ratios), 2) if ratios else None}
    return out


async def drained(server: Server, timeout: float = 60.0) -> None:
    """Wait until a moetrain server has no request left (those cut off at the deadline are cancelled when it sees
    their connections closed), so that the next round starts on an idle server; other servers: a second."""
    if server.model is not None:
        await asyncio.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = RawConnection(server.url)
        try:
            _, body, _ = await conn.request("GET", "/health")
        finally:
            await conn.close()
        h = json.loads(body)
        if h.get("running", 0) == 0 and h.get("waiting", 0) == 0:
            return
        await asyncio.sleep(0.2)


def as_record(entry: dict) -> dict:
    """``entry`` as a record of results/README.md: a title, and one table row per (comparison, server) with the
    comparison's median per-round tokens/s ratio."""
    rows = []
    for comparison, servers in entry["figures"].items():
        ratio = next((v["median"] if isinstance(v, dict) else v for k, v in servers.items()
                      if not isinstance(v, dict) or "median" in v), "")
        for name, f in servers.items():
            if isinstance(f, dict) and "completed" in f:
                rows.append([comparison, name, f["completed"], f["failed"], f["tokens_per_s"], f["p50_latency_s"],
                             f["p99_latency_s"], ratio])
                ratio = ""  # the ratio is the first server's over the second's: on its row
    return {"title": f"moetrain serve under concurrent clients ({entry['model']} model): "
                     + "; ".join(entry["figures"]),
            "section": "Serving", "date": entry["date"][:10], "cpu": entry["cpu"], "commit": entry["commit"],
            "command": "python benchmarks/" + entry["command"],
            "table": {"columns": ["clients", "server", "completed", "failed", "tokens/s", "p50 latency s",
                                  "p99 latency s", "median per-round tokens/s ratio"], "rows": rows},
            "notes": f"model: preset {entry['model']}; {entry['cores']} cores, load average {entry['load_average']}; "
                     f"settings {entry['settings']}; "
                     f"wall {entry['wall_s']} s"}


def record(results_dir: Path, entry: dict) -> Path:
    """Write ``entry`` as a new record in ``results_dir`` (never overwriting one)."""
    from moetrain.results import write_record

    return write_record(as_record(entry), results_dir, slug="serve-load", numbered=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--train", action="store_true", help="train a run of --preset (tinyshakespeare) first")
    ap.add_argument("--preset", default="cpu-small", help="the preset --train trains (default: cpu-small)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of --train")
    ap.add_argument("--train-tiny", action="store_true", help="--train --preset tiny")
    ap.add_argument("--data", help="the corpus of --train (default: shared/data/tinyshakespeare.txt in a directory "
                                   "above the repository)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-s", type=float, default=10.0, help="seconds per server per round")
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw")
    ap.add_argument("--peer", action="store_true", help="also compare with transformers serve --continuous-batching")
    ap.add_argument("--peer-clients", type=int, default=16)
    ap.add_argument("--peer-only", action="store_true", help="only the comparison with transformers serve")
    ap.add_argument("--temperature", type=float, default=0.8, help="of the first comparison's requests")
    ap.add_argument("--results", default=str(ROOT / "results"), help="directory of the JSON records")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="serve_load_"))
    model_dir = args.model_dir
    if args.train or args.train_tiny:
        if model_dir is not None:
            ap.error("give a model directory or --train, not both")
        corpus = args.data or next((str(d / "shared" / "data" / "tinyshakespeare.txt") for d in ROOT.parents
                                    if (d / "shared" / "data" / "tinyshakespeare.txt").is_file()), None)
        if corpus is None:
            ap.error("--train: no shared/data/tinyshakespeare.txt above the repository; give --data PATH")
        steps, preset = args.steps, "tiny" if args.train_tiny else args.preset
        subprocess.run([sys.executable, "-m", "moetrain", "train", "--preset", preset, "--data", corpus,
                        "--out", str(tmp / "run"), "--no-progress", f"train.steps={steps}",
                        f"train.eval_every={steps}", f"train.ckpt_every={steps}"], check=True,
                       stdout=subprocess.DEVNULL)
        model_dir = str(tmp / "run")
    if model_dir is None:
        ap.error("give a model directory or --train")
    figures: dict = {}
    if not args.peer_only:
        servers = [moetrain_server("moetrain serve (defaults)", model_dir, []),
                   moetrain_server("moetrain serve --threads 1", model_dir, ["--threads", "1"])]
        try:
            figures[f"{args.clients} clients, temperature {args.temperature:g}"] = asyncio.run(
                compare(servers, args.clients, args, args.temperature))
        finally:
            for s in servers:
                s.stop()
    if args.peer or args.peer_only:
        hf_dir = str(tmp / "hf")
        subprocess.run([sys.executable, "-m", "moetrain", "export", model_dir, "--format", "hf", hf_dir], check=True,
                       stdout=subprocess.DEVNULL)
        servers = [moetrain_server("moetrain serve (defaults)", hf_dir, []), transformers_server(hf_dir)]
        try:
            figures[f"{args.peer_clients} clients, same weights, greedy"] = asyncio.run(
                compare(servers, args.peer_clients, args, 0.0))
        finally:
            for s in servers:
                s.stop()
    entry = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "cpu": cpu_model(), "cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
             "commit": commit(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
             "model": model_preset(model_dir),
             "settings": {"max_tokens": args.max_tokens, "requests_per_client_per_round": args.requests,
                          "rounds": args.rounds, "round_s": args.round_s, "client": args.client,
                          "cache": "off"},
             "figures": figures, "wall_s": round(time.monotonic() - started, 1)}
    print(json.dumps(entry, indent=2))
    if not args.no_record:
        print(f"recorded in {record(Path(args.results), entry)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
