"""The engine in a process of its own (serve/engine_process.py, how `moetrain serve` runs on one process): a
start-up failure is the child's own error, a child that dies ends the requests in flight with an error and turns
/health to 503, and /metrics is the front's counters followed by the engine's, each metric once."""

from __future__ import annotations

import argparse
import asyncio
import functools
import re

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
        assert not engine.alive()
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
        refused = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code >= 500 and "error" in refused.json()
    finally:
        srv.stop()
        engine.stop()
