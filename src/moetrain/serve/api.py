"""The HTTP front: OpenAI-compatible ``POST /v1/completions`` (JSON or server-sent events), ``GET /health`` and
``GET /metrics`` (Prometheus text), on FastAPI.

Errors are OpenAI-shaped JSON, ``{"error": {"message", "type", "param", "code"}}``, with ``param`` naming the field:
400 for a bad field or body (malformed JSON, a wrong type, a value out of range, a prompt that does not fit the
context), 413 for a body over ``max_body_bytes``, 429 when the queue is full, 503 when the engine is not running.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from moetrain.serve.cache import cache_key
from moetrain.serve.engine import EngineStopped, Event, GenRequest, QueueFull, next_request_id
from moetrain.serve.routing import RoutingPolicy, check_fields

StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class RoutingRequest(BaseModel):
    """Per-request routing policy (a moetrain extension; see :class:`~moetrain.serve.routing.RoutingPolicy`)."""

    model_config = ConfigDict(extra="forbid")
    policy: Literal["fixed", "threshold", "load"] = "fixed"
    k: Annotated[StrictInt, Field(ge=1)] | None = None
    p: Annotated[StrictFloat, Field(gt=0, le=1)] = 0.9
    k_min: Annotated[StrictInt, Field(ge=1)] | None = None
    k_max: Annotated[StrictInt, Field(ge=1)] | None = None


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions API that this server implements (others are ignored)."""

    model: Annotated[str, Field(strict=True)] | None = None
    prompt: Annotated[str, Field(strict=True, min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=0)] = 16
    temperature: Annotated[StrictFloat, Field(ge=0)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)] | None = None  # what torch.Generator.manual_seed takes
    stop: Annotated[str, Field(strict=True, min_length=1)] | Annotated[
        list[Annotated[str, Field(strict=True, min_length=1)]], Field(max_length=4)] | None = None
    stream: Annotated[bool, Field(strict=True)] = False
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    routing: RoutingRequest | None = None
    return_token_ids: Annotated[bool, Field(strict=True)] = False


def error(status: int, message: str, param: str | None, kind: str = "invalid_request_error",
          headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    counter = getattr(request.app.state, "bad_requests", None)  # /metrics' requests_total{outcome="bad_request"}
    if counter is not None:
        counter.inc()
    errors = exc.errors()
    e = errors[0]
    loc = _field_path(e)
    # a union (stop: str | list) reports one error per branch: a value of a branch's type that breaks its limits
    # (five stop strings) says more than "not a string"
    e = next((x for x in errors if _field_path(x) == loc and not x.get("type", "").endswith("_type")), e)
    if e.get("type") == "json_invalid":
        return error(400, f"malformed JSON body: {e.get('msg')} ({e.get('ctx', {}).get('error', '')})", "body")
    if not loc:
        return error(400, f"request body: {e.get('msg')} (expected a JSON object)", "body")
    param = ".".join(loc)
    value = e.get("input")
    got = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
    shown = "missing" if e.get("type") == "missing" else f"got {got}"
    return error(400, f"{param}: {e.get('msg')}; {shown}", param)


def _field_path(e: dict) -> list[str]:
    """A pydantic error's field names (``["routing", "k"]``), without the union branches' type names and indices."""
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    return [x for x in loc if x not in ("str", "int", "float", "bool") and not x.isdigit()
            and not x.startswith(("list[", "constrained-", "function-"))]


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 (read and discarded first, so the client sees
    the answer rather than a reset connection)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size <= self.max_bytes:
                chunks.append(body)
            more = msg.get("more_body", False)
        if size > self.max_bytes:
            resp = error(413, f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes", "body")
            return await resp(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def create_app(engine, cache=None, max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI app over a started-on-startup :class:`~moetrain.serve.engine.Engine`.

    Args:
        engine: the engine (started by the app's lifespan, stopped at shutdown).
        cache: a response cache (:mod:`moetrain.serve.cache`) or ``None``.
        max_body_bytes: largest accepted request body (413 beyond).
    """
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        if not engine.alive():
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="moetrain serve", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.state.bad_requests = engine.metrics.requests.labels("bad_request")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    served, metrics = engine.served, engine.metrics

    @app.get("/health")
    async def health():
        if not engine.alive():
            return error(503, "engine not running", None, "server_error")
        return {"status": "ok", "model": served.name, "running": len(engine.running), "waiting": len(engine.waiting),
                "slots": engine.num_slots}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(engine, cache, body, request)

    return app


def _check(engine, body: CompletionRequest) -> tuple[list[int] | None, RoutingPolicy | None, JSONResponse | None]:
    """Tokenise and check what pydantic cannot: the context, the routing policy against the model."""
    ids = engine.served.tokenizer.encode(body.prompt).ids
    n = engine.max_seq_len
    if not ids:
        return None, None, error(400, "prompt: encodes to no tokens", "prompt")
    if len(ids) >= n:
        return None, None, error(400, f"prompt: {len(ids)} tokens, but the context is {n} (prompt + max_tokens "
                                 f"must fit)", "prompt")
    if len(ids) + body.max_tokens > n:
        return None, None, error(400, f"max_tokens: {body.max_tokens} + the prompt's {len(ids)} tokens exceed the "
                                 f"context of {n}; at most {n - len(ids)}", "max_tokens")
    policy = None
    if body.routing is not None:
        try:
            check_fields(body.routing.policy, body.routing.model_fields_set - {"policy"})  # none it would ignore
            # a request cannot set the load policy's queue depths: the server's (--load-low / --load-high) apply
            policy = RoutingPolicy(**body.routing.model_dump(), low=engine.policy.low, high=engine.policy.high)
            if engine.moe_blocks:
                c = engine.model.blocks[engine.moe_blocks[0]].ffn.config
                policy.bounds(c.top_k, c.num_experts)
        except ValueError as e:
            field = str(e).split(":")[0]
            return None, None, error(400, f"routing.{e}", f"routing.{field}")
    return ids, policy, None


def _result(body: CompletionRequest, rid: str, model: str, text: str, token_ids: list[int], finish: str | None,
            prompt_tokens: int) -> dict:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    if body.return_token_ids:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids),
                                           "total_tokens": prompt_tokens + len(token_ids)}}


async def _complete(engine, cache, body: CompletionRequest, request: Request):
    ids, policy, err = _check(engine, body)
    if err is not None or ids is None:
        engine.metrics.requests.labels("bad_request").inc()
        return err
    rid, name = next_request_id(), engine.served.name
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    key = None
    effective = policy or engine.policy
    if cache is not None and (body.temperature == 0 or body.seed is not None) and effective.policy != "load":
        key = cache_key(engine.served.fingerprint, {
            "prompt": body.prompt, "max_tokens": body.max_tokens, "temperature": body.temperature,
            "top_p": body.top_p if body.temperature > 0 else None, "seed": body.seed if body.temperature > 0 else None,
            "stop": list(stops), "routing": effective.__dict__, "int8_router": bool(engine.runner.int8_routers),
            "int8_experts": getattr(engine, "int8_experts", None) is not None})
        hit = await asyncio.to_thread(cache.get, key)
        if hit is not None:
            engine.metrics.cache_hits.inc()
            engine.metrics.requests.labels("cached").inc()
            cached = [Event(hit["text"], tuple(hit["token_ids"]), hit["finish_reason"])]
            return _respond(body, rid, name, len(ids), cached, None, None)
        engine.metrics.cache_misses.inc()
    if body.max_tokens == 0:
        return _result(body, rid, name, "", [], "length", len(ids))
    loop = asyncio.get_running_loop()
    arrived: list[Event] = []  # events delivered on this loop (engine._deliver), not yet read
    woken = asyncio.Event()

    def emit(ev: Event) -> None:
        arrived.append(ev)
        woken.set()

    req = GenRequest(ids, body.max_tokens, emit, body.temperature, body.top_p, body.seed, stops, policy,
                     loop=loop, incremental=body.stream)
    try:
        engine.submit(req)
    except QueueFull as e:
        engine.metrics.requests.labels("rejected").inc()
        return error(429, f"server busy: {e}; retry later", None, "rate_limit_exceeded", {"Retry-After": "1"})
    except EngineStopped as e:
        return error(503, str(e), None, "server_error")

    async def events():
        """Lists of events: all that have arrived (one engine step's, or several when this loop lagged)."""
        try:
            while True:
                if not arrived:
                    try:
                        async with asyncio.timeout(0.5):  # a timer handle, not a task per wake-up as wait_for
                            await woken.wait()
                    except TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                woken.clear()
                got = arrived[:]
                del arrived[:]
                yield got
                if got[-1].finish_reason is not None:
                    return
        finally:
            if req.finish_reason is None:
                engine.cancel(req)  # the client left (or the stream was closed): free the slot

    save = None
    if key is not None:
        async def save(text, token_ids, finish):
            if finish in ("stop", "length"):
                await asyncio.to_thread(cache.put, key, {"text": text, "token_ids": token_ids,
                                                         "finish_reason": finish})
    return await _respond_live(body, rid, name, len(ids), events(), save) if not body.stream else \
        _respond(body, rid, name, len(ids), None, events(), save)


async def _respond_live(body, rid, name, prompt_tokens, events, save):
    text, token_ids, finish, err = "", [], None, None
    async for got in events:
        for ev in got:
            text += ev.text
            token_ids += ev.token_ids
            finish, err = ev.finish_reason, ev.error
    if err is not None or finish is None:
        return error(500, f"generation failed: {err or 'cancelled'}", None, "server_error")
    if save is not None:
        await save(text, token_ids, finish)
    return _result(body, rid, name, text, token_ids, finish, prompt_tokens)


def _respond(body, rid, name, prompt_tokens, done_events, live_events, save):
    """A cached result (``done_events``) or a live one, as JSON or as server-sent events."""
    if not body.stream:
        ev = done_events[0]
        return _result(body, rid, name, ev.text, list(ev.token_ids), ev.finish_reason, prompt_tokens)

    async def sse():
        text, token_ids = "", []
        source = _aiter([done_events]) if done_events is not None else live_events
        try:
            async for got in source:  # one write per list: a step's events (or a lagging loop's backlog)
                chunks = []
                for ev in got:
                    text += ev.text
                    token_ids += ev.token_ids
                    chunk = _result(body, rid, name, ev.text, list(ev.token_ids), ev.finish_reason, prompt_tokens)
                    del chunk["usage"]
                    if ev.error is not None:
                        chunk["error"] = {"message": ev.error, "type": "server_error"}
                    chunks.append(f"data: {json.dumps(chunk)}\n\n")
                    if ev.finish_reason is not None:
                        chunks.append("data: [DONE]\n\n")
                yield "".join(chunks)
                last = got[-1]
                if last.finish_reason is not None and save is not None and last.error is None:
                    await save(text, token_ids, last.finish_reason)
        finally:
            await source.aclose()  # a client that left: the live source's finally frees the slot now

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _aiter(items):
    for x in items:
        yield x
