"""Bad and hostile requests against `moetrain serve` at the default thread count: each kind answered in OpenAI's
error shape (``{"error": {"message", "type", "param", "code"}}``) or closed on time, while a bystander client's
requests keep getting their answers; afterwards the server is healthy and /metrics has counted every outcome. Also
per-request isolation: a request whose sampling fails gets its own error, the others in flight are unaffected."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import socket
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from _serve_util import at_default_threads, one_thread_now, start_server, train_tiny  # noqa: E402

from moetrain.model.generate import generate  # noqa: E402
from moetrain.serve.loader import load_served_model  # noqa: E402
from moetrain.serve.server import Limits  # noqa: E402

HEADER_S, READ_S, MAX_CONN = 1.0, 1.0, 48
REFUSED: list[int] = []  # the 503s test_many_half_sent_requests_are_bounded_and_closed saw: /metrics must count them


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = train_tiny(tmp_path_factory.mktemp("serve_hostile"))
    at_default_threads()  # the in-process training left one thread; serving runs at the default
    return load_served_model(str(run))


def _reference(sm, prompt: str, n: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    ids = sm.tokenizer.encode(prompt).ids
    out = generate(sm.model, torch.tensor([ids]), n, temperature, 1.0, eos_id=sm.eos_id,
                   generator=torch.Generator().manual_seed(seed))
    return out[0, len(ids):].tolist()


class Bystander:
    """A well-behaved client sending seeded requests one after another in a thread; records every outcome."""

    def __init__(self, url: str):
        self.url, self.results, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            i = 0
            while not self.stop.is_set():
                body = {"prompt": "ROMEO:", "max_tokens": 6, "temperature": 0.9, "seed": i % 3,
                        "return_token_ids": True}
                try:
                    r = c.post("/v1/completions", json=body)
                    self.results.append((i % 3, r.status_code, r.json()["choices"][0]["token_ids"]
                                         if r.status_code == 200 else r.text))
                except httpx.HTTPError as e:
                    self.results.append((i % 3, None, repr(e)))
                i += 1


@pytest.fixture(scope="module")
def server(served):
    srv, engine = start_server(served, num_slots=8, max_queue=16,
                               limits=Limits(max_connections=MAX_CONN, header_timeout_s=HEADER_S),
                               app_kwargs={"read_timeout_s": READ_S, "max_body_bytes": 1 << 20})
    bystander = Bystander(srv.url)
    bystander.thread.start()
    yield srv, engine, bystander
    bystander.stop.set()
    bystander.thread.join(timeout=60)
    srv.stop()


def _connect(url: str) -> socket.socket:
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _read_response(s: socket.socket, wait: float) -> tuple[int | None, dict, bytes]:
    """(status, headers, body) of one response, or (None, {}, b"") when the server closed without one."""
    s.settimeout(wait)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            if not got:
                return None, {}, b""
            data += got
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        n = int(headers.get("content-length", 0))
        while len(body) < n:
            got = s.recv(65536)
            if not got:
                break
            body += got
        return int(lines[0].split()[1]), headers, body
    except (ConnectionError, socket.timeout):
        return None, {}, b""


def _raw(url: str, pieces: list[bytes], pause: float = 0.0, wait: float = 10.0):
    """Send ``pieces`` (``pause`` s apart) on a new connection; (status, headers, body, seconds to the answer or
    the close)."""
    s = _connect(url)
    t0 = time.monotonic()
    try:
        for p in pieces:
            s.sendall(p)
            time.sleep(pause)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed already
    status, headers, body = _read_response(s, wait)
    s.close()
    return status, headers, body, time.monotonic() - t0


def _post(body: bytes, content_type: str = "application/json", path: str = "/v1/completions",
          extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


# (name, raw request pieces, expected status); every answer must be OpenAI-shaped
KINDS = [
    ("malformed JSON", [_post(b"{not json")], 400),
    ("a JSON array", [_post(b"[1, 2, 3]")], 400),
    ("a JSON string", [_post(b'"hello"')], 400),
    ("an empty body", [_post(b"")], 400),
    ("prompt of a wrong type", [_post(b'{"prompt": 42}')], 400),
    ("max_tokens as a string", [_post(b'{"prompt": "x", "max_tokens": "5"}')], 400),
    ("max_tokens 10^9", [_post(b'{"prompt": "x", "max_tokens": 1000000000}')], 400),
    ("max_tokens 1e400 (inf)", [_post(b'{"prompt": "x", "max_tokens": 1e400}')], 400),
    ("an integer of 5,000 digits", [_post(b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}")], 400),
    ("temperature NaN", [_post(b'{"prompt": "x", "temperature": NaN}')], 400),
    ("temperature -Infinity", [_post(b'{"prompt": "x", "temperature": -Infinity}')], 400),
    ("seed 2^70", [_post(b'{"prompt": "x", "seed": 1180591620717411303424}')], 400),
    ("logit_bias of 5,000 bad ids", [_post(json.dumps({"prompt": "x", "logit_bias": {
        str(10**6 + i): 1 for i in range(5000)}}).encode())], 400),
    ("n beyond the queue", [_post(b'{"prompt": "x", "n": 100}')], 400),
    ("a field the server does not implement", [_post(b'{"prompt": "x", "tools": []}')], 400),
    ("a wrong model", [_post(b'{"prompt": "x", "model": "gpt-4"}')], 404),
    ("a prompt longer than the context", [_post(json.dumps({"prompt": "word " * 2000}).encode())], 400),
    ("invalid UTF-8", [_post(b'{"prompt": "\xff\xfe\xfd"}')], 400),
    ("a lone surrogate escape", [_post(b'{"prompt": "\\ud800"}')], 400),
    ("JSON nested 100,000 deep", [_post(_deep(100_000))], 400),
    ("a field nested 50,000 deep", [_post(b'{"prompt": ' + _deep(50_000) + b"}")], 400),
    ("chat: no messages", [_post(b'{"messages": []}', path="/v1/chat/completions")], 400),
    ("chat: an image part", [_post(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}).encode(), path="/v1/chat/completions")], 400),
    ("chat: an unknown role", [_post(b'{"messages": [{"role": "wizard", "content": "x"}]}',
                                     path="/v1/chat/completions")], 400),
    ("a body over the limit (2 MiB)", [_post(b'{"prompt": "' + b"a" * (2 << 20) + b'"}')], 413),
    ("an unknown path", [b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n"], 404),
    ("a wrong method", [b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"], 405),
    ("not HTTP at all", [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n"], 400),
    ("a header line of 1 MiB", [b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"], 400),
    ("a broken chunked body", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"zz\r\nhello\r\n0\r\n\r\n"], 400),
]


@pytest.mark.parametrize("name, pieces, status", KINDS, ids=[k[0] for k in KINDS])
def test_each_bad_request_gets_an_openai_error(server, name, pieces, status):
    got, headers, body, _ = _raw(server[0].url, pieces)
    assert got == status, (name, got, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err


def test_extreme_but_valid_numbers_are_normalised(server, served):
    """temperature / top_p of 1e-300 underflow to 0 in fp32 (they failed the whole engine step); now a tiny
    temperature is greedy and a tiny top_p keeps the most likely token: both answer the greedy completion."""
    want = _reference(served, "hello", 4)
    with httpx.Client(base_url=server[0].url, timeout=60) as c:
        for extra in ({"temperature": 1e-300}, {"top_p": 1e-300, "seed": 3}, {"temperature": 1e-300, "top_p": 1e-300}):
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "return_token_ids": True, **extra})
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["token_ids"] == want, extra


def test_slow_half_sent_and_silent_connections_are_closed_on_time(server):
    url = server[0].url
    # headers sent byte by byte, slower than the header time-out
    status, _, body, seconds = _raw(url, [bytes([b]) for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
                                    pause=0.1)
    assert status in (408, None) and seconds < HEADER_S + 5.0, (status, seconds)
    # headers never finished
    status, _, body, seconds = _raw(url, [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"])
    assert status == 408 and seconds < HEADER_S + 2.0 and json.loads(body)["error"]["message"]
    # a connection that sends nothing
    status, _, _, seconds = _raw(url, [])
    assert status == 408 and seconds < HEADER_S + 2.0
    # a body announced and never (or only partly) sent
    status, _, body, seconds = _raw(url, [_post(b'{"prompt": "x"}')[:-5]])
    assert status == 408 and seconds < READ_S + 2.0 and json.loads(body)["error"]["param"] == "body"
    # a body sent slowly, past the read time-out
    status, _, _, seconds = _raw(url, [_post(b'{"prompt": "hello there", "max_tokens": 2}')[:-20]] +
                                 [b" "] * 20, pause=0.1)
    assert status in (408, None) and seconds < READ_S + 5.0


def test_many_half_sent_requests_are_bounded_and_closed(server):
    """200 half-sent requests: those over the connection limit are refused at once (503, Retry-After), the rest
    closed after the header time-out; meanwhile and afterwards a normal request is answered."""
    url = server[0].url
    socks = []
    t_open = time.monotonic()
    for _ in range(200):
        s = _connect(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.monotonic()
    answers = [_read_response(s, HEADER_S + 5.0) for s in socks]
    seconds = time.monotonic() - t0
    statuses = [a[0] for a in answers]
    REFUSED.append(statuses.count(503))
    # All 200 opened within the header time-out: none of the first MAX_CONN timed out (freeing its place) before the
    # last opened, so every one over the limit was refused. On a starved machine the opening can take longer than
    # the time-out: then places free up as they time out and only some are refused.
    at_once = t0 - t_open < HEADER_S / 2
    assert set(statuses) <= {408, 503} and REFUSED[-1] >= (200 - MAX_CONN if at_once else 1), statuses
    assert all(a[1].get("retry-after") == "1" for a in answers if a[0] == 503)
    assert seconds < HEADER_S + 5.0
    for s in socks:
        s.close()
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_disconnects_free_their_slots_and_are_counted(server):
    srv, engine, _ = server
    before = _outcomes(srv.url)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        # long requests (4 choices x 110 tokens: hundreds of steps), so that they cannot end before the client leaves
        with c.stream("POST", "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 110, "stream": True,
                                                       "temperature": 0.9, "n": 4}) as r:
            next(r.iter_lines())  # one chunk, then leave
    # a non-streaming client that leaves while its request runs
    s = _connect(srv.url)
    s.sendall(_post(b'{"prompt": "The king", "max_tokens": 109, "temperature": 0.9, "n": 4}'))
    admitted = time.monotonic() + 30  # leave once it runs (on a loaded machine it may not have been read yet)
    while time.monotonic() < admitted and not any(r.max_tokens == 109 for r in list(engine.running)):
        time.sleep(0.01)
    s.close()
    # a body cut off by a disconnect
    s = _connect(srv.url)
    s.sendall(_post(b'{"prompt": "The king", "max_tokens": 100}')[:-10])
    s.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _outcomes(srv.url).get("cancelled", 0) - before.get("cancelled", 0) < 3:
        time.sleep(0.1)
    assert _outcomes(srv.url).get("cancelled", 0) - before.get("cancelled", 0) == 3
    while time.monotonic() < deadline and any(r.max_tokens in (109, 110) for r in list(engine.running)):
        time.sleep(0.1)
    assert not any(r.max_tokens in (109, 110) for r in engine.running)  # both long requests were dropped


def _outcomes(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^moetrain_requests_total\{outcome="(\w+)"\} (\S+)$',
                                                               text, re.M)}


def test_the_bystander_was_unaffected_and_every_outcome_is_counted(server, served):
    """Runs last: the bystander's every request got 200 and its seed's answer, the server is healthy, and /metrics
    has the outcomes of what this module sent."""
    srv, _, bystander = server
    bystander.stop.set()
    bystander.thread.join(timeout=60)
    assert len(bystander.results) >= 5
    # every answer whole (token for token equality with the request alone is asserted at one thread, below and in
    # test_serve_api: at several, other batch sizes may round differently in the last bits)
    bad = [(s, code, got) for s, code, got in bystander.results
           if code != 200 or not (len(got) == 6 or got[-1] == served.eos_id)]
    assert not bad, bad[:3]
    assert httpx.get(srv.url + "/health", timeout=30).json()["status"] == "ok"
    outcomes = _outcomes(srv.url)
    assert outcomes["ok"] >= len(bystander.results)
    assert outcomes["bad_request"] >= sum(1 for k in KINDS if 400 <= k[2] < 500)
    assert outcomes["timeout"] >= 5 and outcomes["rejected"] >= sum(REFUSED) and outcomes["cancelled"] >= 3


@pytest.fixture
def one_thread_here():  # conftest's one_thread is module-wide
    with one_thread_now():
        yield


def test_a_request_whose_sampling_fails_fails_alone(served, one_thread_here):
    """Eleven requests in flight; one's sampling raises (a logit_bias token outside the vocabulary, which the HTTP
    API refuses up front, sent to the engine directly): it gets its own error event, the ten others their solo
    answers."""
    from moetrain.model.sampling import SamplingParams
    from moetrain.serve.engine import Engine, GenRequest

    engine = Engine(served, num_slots=16)
    engine.start()
    try:
        events: dict[int, list] = {i: [] for i in range(11)}
        done = threading.Semaphore(0)

        def emit_for(i):
            def emit(ev):
                events[i].append(ev)
                if ev.finish_reason:
                    done.release()
            return emit

        prompts = [f"ROMEO {i}:" for i in range(11)]
        reqs = [GenRequest(served.tokenizer.encode(p).ids, 8, emit_for(i), SamplingParams(0.8), i)
                for i, p in enumerate(prompts)]
        reqs[5].sampling = SamplingParams(0.8, logit_bias=((10**6, 1.0),))
        with engine.cond:  # all in the same steps
            engine.submit(*reqs)
        for _ in reqs:
            assert done.acquire(timeout=120)
    finally:
        engine.stop()
    assert events[5][-1].finish_reason == "error" and "vocabulary" in events[5][-1].error
    for i in (j for j in range(11) if j != 5):
        assert events[i][-1].finish_reason == "length", events[i][-1]
        assert [t for ev in events[i] for t in ev.token_ids] == _reference(served, prompts[i], 8, 0.8, seed=i)


def test_tiny_temperature_among_ten_others_over_http(server, served, one_thread_here):
    """The issue's case: {"prompt": "hello", "max_tokens": 4, "temperature": 1e-300} in flight with ten seeded
    requests: all eleven are answered, the ten with their solo answers."""
    url = server[0].url

    def one(body):
        with httpx.Client(base_url=url, timeout=120) as c:
            return c.post("/v1/completions", json={**body, "return_token_ids": True})

    bodies = [{"prompt": f"The king {i}", "max_tokens": 8, "temperature": 0.8, "seed": i} for i in range(10)]
    bodies.insert(4, {"prompt": "hello", "max_tokens": 4, "temperature": 1e-300})
    with cf.ThreadPoolExecutor(11) as pool:
        answers = list(pool.map(one, bodies))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    for body, r in zip(bodies, answers):
        want = _reference(served, body["prompt"], body["max_tokens"], body["temperature"], body.get("seed", 0))
        assert r.json()["choices"][0]["token_ids"] == want


def test_a_huge_prompt_does_not_stall_the_server(server):
    """Tokenization runs off the event loop, and a prompt far over the context is refused from a prefix: /health
    answers while 1 MB prompts are refused (each took seconds of tokenizing on the event loop, in turn; the bound
    leaves room for a shared machine's hiccups)."""
    url = server[0].url
    text = "def x(self, y):\n    return self.z(w) " * 25_000  # ~1 MB
    with cf.ThreadPoolExecutor(4) as pool:
        big = [pool.submit(httpx.post, url + "/v1/completions", json={"prompt": text[:1_000_000]}, timeout=60)
               for _ in range(4)]
        waits = []
        while not all(f.done() for f in big):
            t0 = time.monotonic()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            waits.append(time.monotonic() - t0)
        answers = [f.result() for f in big]
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "prompt" for r in answers)
    assert "context" in answers[0].json()["error"]["message"]
    assert max(waits, default=0.0) < 3.0, waits  # on the event loop: 2 s or more per 1 MB prompt, one after another


def test_an_unexpected_error_is_an_openai_500_and_counted(served, monkeypatch):
    """Whatever escapes an endpoint (here: a bug planted in request preparation) is answered 500 in OpenAI's shape
    (uvicorn's plain-text 500 before), counted as an error, and the server goes on."""
    from moetrain.serve.api import Api

    prepare = Api.prepare

    def planted(self, raw, chat):
        if b"boom" in raw:
            raise RuntimeError("planted bug")
        return prepare(self, raw, chat)

    monkeypatch.setattr(Api, "prepare", planted)
    srv, _ = start_server(served, num_slots=2)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "boom"})
            assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and set(err) == {"message", "type", "param", "code"}
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        assert _outcomes(srv.url) == {"error": 1.0, "ok": 1.0}
    finally:
        srv.stop()
