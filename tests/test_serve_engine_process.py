"""The engine in a process of its own (serve/engine_process.py, how `moetrain serve` runs on one process): a
start-up failure is the child's own error, a child that dies ends the requests in flight with an error, turns
/health to 503 and stops `moetrain serve` with that error, /metrics is the front's counters followed by the
engine's (each metric once, never another question's answer), cancelled requests free their queue places at once,
and SIGTERM shuts the server down as Ctrl+C does."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import signal
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from _serve_util import train_tiny  # noqa: E402

from moetrain.errors import MoetrainError  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("engine_process"))


def serve_args(*argv: str) -> argparse.Namespace:
    from moetrain.commands import serve as serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv, "--port", "0", "--threads", "1"])


def test_a_failed_start_is_the_childs_error(tmp_path):
    from moetrain.commands.serve import build_engine
    from moetrain.serve.engine_process import RemoteEngine

    engine = RemoteEngine(functools.partial(build_engine, serve_args(str(tmp_path / "no-such-run"))))
    with pytest.raises(MoetrainError, match="no-such-run"):
        engine.start()
    assert not engine.alive()


def test_front_and_engine_processes(run_dir):
    from moetrain.commands.serve import build_app
    from moetrain.serve.engine import GenRequest
    from moetrain.serve.server import BackgroundServer

    app, engine = build_app(serve_args(str(run_dir), "--cache", "off"))
    srv = BackgroundServer(app).start()
    try:
        body = {"prompt": "ROMEO:", "max_tokens": 5}
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] > 0
        assert httpx.get(srv.url + "/health", timeout=30).json()["running"] == 0

        text = httpx.get(srv.url + "/metrics", timeout=30).text
        helps = re.findall(r"^# HELP (\S+)", text, re.M)
        assert len(helps) == len(set(helps)), sorted(h for h in helps if helps.count(h) > 1)
        assert 'moetrain_requests_total{outcome="ok"} 1.0' in text  # the front's
        generated = float(re.search(r"^moetrain_generated_tokens_total (\S+)$", text, re.M).group(1))
        assert generated == got.json()["usage"]["completion_tokens"]  # the engine's

        async def killed_mid_request() -> list:
            events: list = []
            done = asyncio.Event()

            def emit(event):
                events.append(event)
                if event.finish_reason is not None:
                    done.set()

            ids = engine.served.tokenizer.encode("ROMEO:").ids
            engine.submit(GenRequest(ids, 10_000, emit, loop=asyncio.get_running_loop()))
            while not events:  # decoding
                await asyncio.sleep(0.01)
            engine._proc.kill()
            await asyncio.wait_for(done.wait(), 30)
            return events

        events = asyncio.run(killed_mid_request())
        assert events[-1].finish_reason == "error" and "engine process exited" in events[-1].error
        assert not engine.alive() and engine.exit_message == "the engine process exited (killed by SIGKILL)"
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
        refused = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code >= 500 and "error" in refused.json()
    finally:
        srv.stop()
        engine.stop()


def test_a_stuck_engine_holds_up_neither_health_nor_later_metrics(run_dir):
    """/health answers from the front's own count at once; a metrics answer that comes late (the engine stopped,
    then resumed) is dropped, never read as the next question's."""
    from moetrain.commands.serve import build_app
    from moetrain.serve.server import BackgroundServer

    app, engine = build_app(serve_args(str(run_dir), "--cache", "off"))
    engine.call_timeout_s = 0.5
    srv = BackgroundServer(app).start()
    try:
        os.kill(engine._proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=30).json()["running"] == 0
            assert time.monotonic() - t0 < 0.4  # no round trip to the stopped engine
            front_only = httpx.get(srv.url + "/metrics", timeout=30).text  # its question goes unanswered
            assert "moetrain_requests_total" in front_only and "moetrain_generated_tokens" not in front_only
        finally:
            os.kill(engine._proc.pid, signal.SIGCONT)
        for _ in range(3):  # the late answer is in the pipe now: each scrape still gets its own
            text = httpx.get(srv.url + "/metrics", timeout=30).text
            assert text.count("# HELP moetrain_generated_tokens_total") == 1, text[:300]
    finally:
        srv.stop()
        engine.stop()


def test_cancelled_waiting_requests_free_their_places_at_once(run_dir):
    """One slot, a queue of 2: with both places taken by requests that were then cancelled, two new requests are
    queued (the engine must not count the cancelled ones until its next step): no error, as the front promised."""
    from moetrain.commands.serve import build_engine
    from moetrain.serve.engine import GenRequest
    from moetrain.serve.engine_process import RemoteEngine

    engine = RemoteEngine(functools.partial(build_engine, serve_args(str(run_dir), "--slots", "1",
                                                                     "--max-queue", "2")))
    engine.start()
    try:
        async def scenario() -> dict:
            loop, ends, done = asyncio.get_running_loop(), {}, asyncio.Event()
            ids = engine.served.tokenizer.encode("ROMEO:").ids

            def request(name: str, tokens: int) -> GenRequest:
                def emit(event):
                    if event.finish_reason is not None:
                        ends[name] = (event.finish_reason, event.error)
                        if {"d", "e"} <= ends.keys():
                            done.set()
                return GenRequest(ids, tokens, emit, loop=loop)

            running = request("a", 900)
            engine.submit(running)
            while engine.occupancy() != (1, 0):
                await asyncio.sleep(0.01)
            waiting = [request("b", 4), request("c", 4)]
            for _ in range(5):  # several rounds: the cancel and the next submit race the engine's step
                engine.submit(*waiting)
                for req in waiting:
                    engine.cancel(req)
                waiting = [request("b", 4), request("c", 4)]
            engine.submit(request("d", 2), request("e", 2))
            engine.cancel(running)
            await asyncio.wait_for(done.wait(), 60)
            return ends

        ends = asyncio.run(scenario())
        assert ends["d"][0] != "error" and ends["e"][0] != "error", ends
    finally:
        engine.stop()


def _start_cli(run_dir) -> tuple[subprocess.Popen, int]:
    """`moetrain serve RUN --port 0` in a process group of its own; (process, engine child pid) once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "moetrain", "serve", str(run_dir), "--port", "0", "--threads", "1"],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        if "moetrain serve: running on" in line or time.monotonic() > deadline:
            break
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
    pids = [int(p) for p in children.stdout.split()]
    engine = [p for p in pids if "spawn_main" in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
    assert len(engine) == 1, (pids, engine)
    return proc, engine[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cli_stops_with_its_engine_and_on_sigterm(run_dir):
    proc, child = _start_cli(run_dir)
    os.kill(child, signal.SIGKILL)
    assert proc.wait(timeout=30) == 2
    assert "moetrain: error: stopped: the engine process exited (killed by SIGKILL)" in proc.stderr.read()

    proc, child = _start_cli(run_dir)
    proc.send_signal(signal.SIGTERM)  # the parent alone, as a supervisor sends it
    assert proc.wait(timeout=60) == 130
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}"), "the engine process outlived the server"
