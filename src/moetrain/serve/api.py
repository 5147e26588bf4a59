"""The HTTP front, OpenAI-compatible: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or
server-sent events), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text), on FastAPI.

Every error is OpenAI-shaped JSON, ``{"error": {"message", "type", "param", "code"}}``, with ``param`` naming the
field: 400 for a bad field or body (malformed JSON, a wrong type, a value out of range, a field this server does not
implement, a prompt that does not fit the context), 404 for an unknown path or model (``code: model_not_found``),
405 for a wrong method, 408 for a body that did not arrive within the read time-out, 413 for a body over
``max_body_bytes``, 429 (``Retry-After``) when the queue is full, 500 when generation failed, 503 when the engine is
not running. Bodies over :data:`INLINE_PREPARE_BYTES` are parsed, validated and tokenized in worker threads, so
that no request holds up the event loop for long. Every request
but ``/health`` and ``/metrics`` is counted once in ``moetrain_requests_total{outcome}`` (:func:`outcome_of`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moetrain.model.sampling import SamplingParams
from moetrain.serve.cache import cache_key
from moetrain.serve.chat import load_chat_template
from moetrain.serve.engine import EngineStopped, Event, GenRequest, QueueFull, TokenLogprob, next_request_id
from moetrain.serve.routing import RoutingPolicy, check_fields

log = logging.getLogger("moetrain.serve")

StrictInt = Annotated[int, Field(strict=True)]
StrictFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
StrictStr = Annotated[str, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
TokenId = Annotated[StrictInt, Field(ge=0)]
StopStr = Annotated[str, Field(strict=True, min_length=1)]
MAX_CHOICES = 128  # n x prompts of one request, at most (and never more than the queue holds)
PREFIX_CHARS_PER_TOKEN = 16  # a prompt longer than this x the context is first tokenised in part (Api._encode)
PREFIX_MARGIN = 8  # tokens the cut at the prefix's end may add
# Bodies up to this size are parsed and tokenised on the event loop (well under a millisecond); larger ones on a
# worker thread, so that a huge prompt cannot freeze the loop. For a typical request the hop to a worker and back
# costs more than the work (inline, 16 clients gained ~10% tokens/s in benchmarks/serve_load.py).
INLINE_PREPARE_BYTES = 16 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RoutingRequest(_Strict):
    """Per-request routing policy (a moetrain extension; see :class:`~moetrain.serve.routing.RoutingPolicy`)."""

    policy: Literal["fixed", "threshold", "load"] = "fixed"
    k: Annotated[StrictInt, Field(ge=1)] | None = None
    p: Annotated[StrictFloat, Field(gt=0, le=1)] = 0.9
    k_min: Annotated[StrictInt, Field(ge=1)] | None = None
    k_max: Annotated[StrictInt, Field(ge=1)] | None = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Generation(_Strict):
    """The fields both endpoints share (OpenAI's names, ranges and defaults). Any other field is refused (400
    naming it): nothing a client sends is silently ignored."""

    model: StrictStr | None = None
    temperature: Annotated[StrictFloat, Field(ge=0)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)] | None = None  # what torch.Generator.manual_seed takes
    stop: StopStr | Annotated[list[StopStr], Field(max_length=4)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100, le=100)]] | None = None
    user: StrictStr | None = None  # an end-user id (OpenAI: for abuse monitoring); not used for generation
    routing: RoutingRequest | None = None
    return_token_ids: StrictBool = False


class CompletionRequest(_Generation):
    """``POST /v1/completions``: a prompt (text, token ids, or a list of either) continued."""

    prompt: Annotated[str, Field(strict=True, min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] | \
        Annotated[list[Annotated[str, Field(strict=True, min_length=1)]], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=0)] = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    suffix: StrictStr | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``: messages rendered by the chat template (:mod:`moetrain.serve.chat`)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # default: the rest of the context
    max_completion_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class ApiError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code, self.headers = (status, message, param, kind,
                                                                                     code, headers)

    def response(self) -> JSONResponse:
        return error(self.status, self.message, self.param, self.kind, self.headers, self.code)


def error(status: int, message: str, param: str | None, kind: str = "invalid_request_error",
          headers: dict | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(errors: list) -> tuple[str, str]:
    """(message, param) of pydantic's errors: the first one, naming its field and the value it got."""
    e = errors[0]
    loc = _field_path(e)
    # a union (stop: str | list) reports one error per branch: a value of a branch's type that breaks its limits
    # (five stop strings) says more than "not a string"
    e = next((x for x in errors if _field_path(x) == loc and not x.get("type", "").endswith("_type")), e)
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('msg')} ({e.get('ctx', {}).get('error', '')})", "body"
    if not loc:
        return f"request body: {e.get('msg')} (expected a JSON object)", "body"
    param = ".".join(loc)
    if e.get("type") == "extra_forbidden":
        return (f"{param}: not supported by this server (an OpenAI field it does not implement, or a misspelt "
                "one); remove it", param)
    value = e.get("input")
    got = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
    shown = "missing" if e.get("type") == "missing" else f"got {got}"
    return f"{param}: {e.get('msg')}; {shown}", param


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(list(exc.errors()))
    return error(400, message, param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error(exc.status_code, message, None, "invalid_request_error" if exc.status_code < 500 else "server_error",
                 dict(exc.headers or {}), {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))


def _field_path(e: dict) -> list[str]:
    """A pydantic error's field names (``["routing", "k"]``), without the union branches' type names and indices."""
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    return [x for x in loc if x not in ("str", "int", "float", "bool") and not x.isdigit()
            and not x.startswith(("list[", "constrained-", "function-", "json-or-python["))]


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def outcome_of(status: int | None, complete: bool) -> str:
    """The ``outcome`` label of a request: ``ok`` (2xx, body sent), ``cancelled`` (the client left first),
    ``timeout`` (408), ``rejected`` (429, 503: busy or stopped), ``bad_request`` (other 4xx) or ``error`` (5xx)."""
    if status is None or not complete:
        return "cancelled"
    if status < 400:
        return "ok"
    if status == 408:
        return "timeout"
    if status in (429, 503):
        return "rejected"
    return "bad_request" if status < 500 else "error"


class RequestGuard:
    """ASGI middleware around the whole app: reads the body first, within ``read_timeout_s`` (else 408) and up to
    ``max_bytes`` (else 413; the rest is read and discarded, so the client sees the answer rather than a reset),
    answers any exception that escapes with an OpenAI-shaped 500, and counts each request's outcome
    (:func:`outcome_of`; an endpoint may set its own in ``scope["moetrain.outcome"]``, e.g. ``error`` for a stream
    that failed after its 200)."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float, count):
        self.app, self.max_bytes, self.read_timeout_s, self.count = app, max_bytes, read_timeout_s, count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen: dict[str, Any] = {"status": None, "complete": False}
        scope["moetrain.outcome"] = seen

        async def watched_send(msg):
            if msg["type"] == "http.response.start":
                seen["status"] = msg["status"]
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                seen["complete"] = True
            await send(msg)

        try:
            await self._serve(scope, receive, watched_send)
        except Exception:  # noqa: BLE001 - whatever escaped: the client gets JSON, the log the traceback
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if seen["status"] is None:
                await error(500, "internal server error (logged by the server)", None, "server_error")(
                    scope, receive, watched_send)
            seen["outcome"] = "error"
        finally:
            if scope.get("path") not in ("/health", "/metrics"):
                self.count(seen.get("outcome") or outcome_of(seen["status"], seen["complete"]))

    async def _serve(self, scope, receive, send):
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.read_timeout_s):
                while more:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    body = msg.get("body", b"")
                    size += len(body)
                    if size <= self.max_bytes:
                        chunks.append(body)
                    else:
                        chunks = []
                    more = msg.get("more_body", False)
        except TimeoutError:
            return await error(408, f"request body not received within {self.read_timeout_s:g} s", "body",
                               headers={"Connection": "close"})(scope, receive, send)
        if size > self.max_bytes:
            return await error(413, f"request body of {size} bytes exceeds the limit of {self.max_bytes} bytes",
                               "body")(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


@dataclass
class Choice:
    """One choice of a request being answered: its prompt, the engine request (``None`` when cached), what it
    received so far."""

    index: int
    prompt: int  # index into Prepared.prompts
    req: GenRequest | None
    key: str | None = None  # response-cache key, when cacheable
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    started: bool = False  # a stream chunk was sent


@dataclass
class Prepared:
    """A validated, tokenised request."""

    chat: bool
    body: Any
    prompts: list[list[int]]
    echo_texts: list[str]
    max_tokens: list[int]
    sampling: SamplingParams
    stops: tuple[str, ...]
    policy: RoutingPolicy | None
    logprobs: int | None


class Api:
    """The endpoints' logic over one engine and optional response cache (built by :func:`create_app`)."""

    def __init__(self, engine, cache):
        self.engine, self.cache = engine, cache
        self.served = engine.served
        self.created = int(time.time())
        self.chat_template = load_chat_template(getattr(self.served, "root", ""))
        # token ids a request may name (prompt, logit_bias): ones both the tokenizer and the embedding have
        self.vocab = min(self.served.tokenizer.get_vocab_size(), engine.vocab_size)

    # --- worker thread: parse, validate, tokenise -----------------------------------------------------------
    def prepare(self, raw: bytes, chat: bool) -> Prepared:
        """Raises :class:`ApiError` (400 / 404) for anything wrong with the request."""
        try:
            obj = json.loads(raw)
        except RecursionError:
            raise ApiError(400, "malformed JSON body: nested too deeply", "body") from None
        except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8/16/32
            raise ApiError(400, f"malformed JSON body: {e}", "body") from None
        try:
            body: Any = (ChatRequest if chat else CompletionRequest).model_validate(obj)
        except ValidationError as e:
            message, param = _validation_message(e.errors())
            raise ApiError(400, message, param) from None
        except RecursionError:
            raise ApiError(400, "request body: nested too deeply", "body") from None
        if body.model is not None and body.model != self.served.name:
            raise ApiError(404, f"The model `{body.model}` does not exist (this server serves `{self.served.name}`; "
                           "GET /v1/models lists it)", "model", code="model_not_found")
        if not chat:
            if body.suffix:
                raise ApiError(400, "suffix: not supported by this server (text insertion needs a model trained "
                               "for it)", "suffix")
            if body.best_of is not None and body.best_of != body.n:
                raise ApiError(400, f"best_of: not supported by this server unless equal to n ({body.n}); got "
                               f"{body.best_of}", "best_of")
            if body.echo and body.logprobs is not None:
                raise ApiError(400, "echo: not with logprobs (the prompt's logprobs are not computed)", "echo")
        elif body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only with stream: true", "stream_options")
        bias: list[tuple[int, float]] = []
        for k, v in (body.logit_bias or {}).items():
            if not k.isdigit() or int(k) >= self.vocab:
                raise ApiError(400, f"logit_bias: keys are token ids in [0, {self.vocab}); got {k[:40]!r}",
                               "logit_bias")
            bias.append((int(k), v))
        sampling = SamplingParams(body.temperature, body.top_p, body.presence_penalty, body.frequency_penalty,
                                  tuple(bias))
        prompts, echo = self._prompts(body, chat)
        n_ctx = self.engine.max_seq_len
        max_tokens = []
        for ids in prompts:
            if len(ids) >= n_ctx:
                raise ApiError(400, f"{'messages' if chat else 'prompt'}: {len(ids)} tokens, but the context is "
                               f"{n_ctx} (prompt + max_tokens must fit)", "messages" if chat else "prompt")
            want = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
            name = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
            if want is None:
                want = n_ctx - len(ids)
            if len(ids) + want > n_ctx:
                raise ApiError(400, f"{name}: {want} + the prompt's {len(ids)} tokens exceed the context of "
                               f"{n_ctx}; at most {n_ctx - len(ids)}", name)
            max_tokens.append(want)
        total = len(prompts) * body.n
        if total > min(MAX_CHOICES, self.engine.max_queue):
            raise ApiError(400, f"n: {body.n} choices x {len(prompts)} prompts = {total}, more than this server "
                           f"takes in one request ({min(MAX_CHOICES, self.engine.max_queue)})", "n")
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        logprobs = (body.top_logprobs or 0 if body.logprobs else None) if chat else body.logprobs
        return Prepared(chat, body, prompts, echo, max_tokens, sampling, stops, self._policy(body), logprobs)

    def _encode(self, text: str, special: bool, param: str) -> list[int]:
        """Token ids of ``text``. A text far longer than the context is refused from a prefix's tokens: when its
        first ``PREFIX_CHARS_PER_TOKEN x context`` characters already make more tokens than the context holds (a
        margin for the cut word), the whole cannot fit, and a 1 MB prompt costs milliseconds, not seconds."""
        n_ctx = self.engine.max_seq_len
        limit = PREFIX_CHARS_PER_TOKEN * n_ctx
        try:  # encode_batch releases the GIL while it runs (a long prompt does not stall the engine thread)
            if len(text) > limit:
                head = self.served.tokenizer.encode_batch([text[:limit]], add_special_tokens=special)[0].ids
                if len(head) >= n_ctx + PREFIX_MARGIN:
                    raise ApiError(400, f"{param}: more than {len(head) - PREFIX_MARGIN} tokens in its first {limit} "
                                   f"of {len(text)} characters, but the context is {n_ctx} (prompt + max_tokens "
                                   "must fit)", param)
            ids = self.served.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate (\ud800) the tokenizer cannot take
            raise ApiError(400, f"{param}: cannot be tokenized: {e}", param) from None
        if not ids:
            raise ApiError(400, f"{param}: encodes to no tokens", param)
        return list(ids)

    def _prompts(self, body, chat: bool) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt, and its text (for ``echo``)."""
        tok = self.served.tokenizer
        if chat:
            messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                         else "".join(p.text for p in m.content)} for m in body.messages]
            try:
                text = self.chat_template.render(messages)
            except ValueError as e:
                raise ApiError(400, f"messages: {e}", "messages") from None
            return [self._encode(text, not self.chat_template.special_tokens, "messages")], [text]
        p = body.prompt
        if isinstance(p, str):
            return [self._encode(p, True, "prompt")], [p]
        if isinstance(p[0], int):
            lists = [p]
        elif isinstance(p[0], str):
            ids = [self._encode(s, True, "prompt") for s in p]
            return ids, list(p)
        else:
            lists = p
        for ids in lists:
            bad = [t for t in ids if t >= self.vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is not in the vocabulary of {self.vocab} tokens",
                               "prompt")
        return [list(x) for x in lists], [tok.decode(list(x)) for x in lists]

    def _policy(self, body) -> RoutingPolicy | None:
        if body.routing is None:
            return None
        engine = self.engine
        try:
            check_fields(body.routing.policy, body.routing.model_fields_set - {"policy"})  # none it would ignore
            # a request cannot set the load policy's queue depths: the server's (--load-low / --load-high) apply
            policy = RoutingPolicy(**body.routing.model_dump(), low=engine.policy.low, high=engine.policy.high)
            if engine.moe_shape is not None:
                policy.bounds(*engine.moe_shape)
        except ValueError as e:
            name = str(e).split(":")[0]
            raise ApiError(400, f"routing.{e}", f"routing.{name}") from None
        return policy

    # --- event loop -----------------------------------------------------------------------------------------
    async def handle(self, request: Request, chat: bool):
        raw = await request.body()
        try:
            prep = (self.prepare(raw, chat) if len(raw) <= INLINE_PREPARE_BYTES
                    else await asyncio.to_thread(self.prepare, raw, chat))
        except ApiError as e:
            return e.response()
        rid = next_request_id().replace("cmpl-", "chatcmpl-", 1) if chat else next_request_id()  # as OpenAI
        loop = asyncio.get_running_loop()
        arrived: list[tuple[Choice, Event]] = []  # delivered on this loop (engine._deliver), not yet read
        woken = asyncio.Event()
        choices = await self._choices(prep, loop, arrived, woken)
        live = [c.req for c in choices if c.req is not None]
        try:
            self.engine.submit(*live)
        except QueueFull as e:
            return error(429, f"server busy: {e}; retry later", None, "rate_limit_exceeded", {"Retry-After": "1"},
                         "rate_limit_exceeded")
        except EngineStopped as e:
            return error(503, str(e), None, "server_error", {"Retry-After": "5"})
        events = self._events(request, choices, arrived, woken)
        outcome = request.scope.get("moetrain.outcome", {})
        if prep.body.stream:
            return StreamingResponse(self._sse(prep, rid, choices, events, outcome), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for _ in events:
            pass
        # the client left: nobody reads this (also when it left during the last half second, which the wait for
        # events polls: a generation that ends first is still the client's loss, not an answer)
        if any(c.finish is None for c in choices) or await request.is_disconnected():
            outcome["outcome"] = "cancelled"
            return error(499, "client closed the request", None)
        failed = next((c for c in choices if c.error is not None), None)
        if failed is not None:
            return error(500, f"generation failed: {failed.error}", None, "server_error")
        await self._save(choices)
        return self._final(prep, rid, choices)

    async def _choices(self, prep: Prepared, loop, arrived, woken) -> list[Choice]:
        """One :class:`Choice` per (prompt, n): a cache hit delivered at once, else an engine request."""
        body, engine = prep.body, self.engine
        effective = prep.policy or engine.policy
        cacheable = self.cache is not None and (prep.sampling.greedy or body.seed is not None) and \
            effective.policy != "load"
        out: list[Choice] = []
        for pi, ids in enumerate(prep.prompts):
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + j
                if seed is not None and seed >= 2**64:
                    seed -= 2**64
                choice = Choice(pi * body.n + j, pi, None)
                if cacheable:
                    s = prep.sampling
                    choice.key = cache_key(self.served.fingerprint, {
                        "prompt_ids": ids, "max_tokens": prep.max_tokens[pi], "temperature": s.temperature,
                        "top_p": s.top_p if not s.greedy else None, "seed": seed if not s.greedy else None,
                        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                        "logit_bias": list(s.logit_bias), "logprobs": prep.logprobs, "stop": list(prep.stops),
                        "routing": effective.__dict__, "int8_router": engine.int8_router,
                        "int8_experts": getattr(engine, "int8_experts", None) is not None})
                    hit = await self._cache_call(self.cache.get, choice.key)
                    if hit is not None:
                        engine.metrics.cache_hits.inc()
                        lps = tuple(TokenLogprob(t, lp, tuple((a, b) for a, b in top))
                                    for t, lp, top in hit.get("logprobs", ()))
                        arrived.append((choice, Event(hit["text"], tuple(hit["token_ids"]), hit["finish_reason"],
                                                      logprobs=lps)))
                        woken.set()
                        out.append(choice)
                        continue
                    engine.metrics.cache_misses.inc()

                def emit(ev: Event, c: Choice = choice) -> None:
                    arrived.append((c, ev))
                    woken.set()

                if prep.max_tokens[pi] == 0:
                    arrived.append((choice, Event("", (), "length")))
                    woken.set()
                else:
                    choice.req = GenRequest(ids, prep.max_tokens[pi], emit, prep.sampling, seed, prep.stops,
                                            prep.policy, logprobs=prep.logprobs, loop=loop,
                                            incremental=body.stream)
                out.append(choice)
        return out

    async def _events(self, request: Request, choices: list[Choice], arrived, woken):
        """Lists of (choice, event): all that have arrived (one engine step's, or several when this loop lagged),
        until every choice has finished; the choices' fields are updated as they arrive. A client that leaves
        cancels its requests."""
        try:
            while any(c.finish is None for c in choices):
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
                for c, ev in got:
                    c.text += ev.text
                    c.token_ids += ev.token_ids
                    c.logprobs += ev.logprobs
                    if ev.finish_reason is not None:
                        c.finish, c.error = ev.finish_reason, ev.error
                yield got
        finally:
            for c in choices:
                if c.req is not None and c.req.finish_reason is None:
                    self.engine.cancel(c.req)  # the client left (or the stream was closed): free the slot

    async def _cache_call(self, fn, *args):
        """A response-cache call: on a worker thread when the cache does network I/O (Redis), else inline."""
        return await asyncio.to_thread(fn, *args) if self.cache.remote else fn(*args)

    async def _save(self, choices: list[Choice]) -> None:
        for c in choices:
            if c.key is not None and c.req is not None and c.finish in ("stop", "length") and self.cache is not None:
                await self._cache_call(self.cache.put, c.key, {
                    "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish,
                    "logprobs": [[x.token_id, x.logprob, [list(a) for a in x.top]] for x in c.logprobs]})

    # --- response bodies ------------------------------------------------------------------------------------
    def _usage(self, prep: Prepared, choices: list[Choice]) -> dict:
        prompt = sum(len(ids) for ids in prep.prompts)
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _token(self, token_id: int) -> str:
        return self.served.tokenizer.decode([token_id])

    def _completion_logprobs(self, lps, offset: int) -> dict:
        tokens = [self._token(x.token_id) for x in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [self._alternatives(x.top) for x in lps], "text_offset": offsets}

    def _alternatives(self, top) -> dict[str, float]:
        """OpenAI's completions format keys alternatives by token text: where ids decode alike (pieces of one
        UTF-8 character), the most likely keeps the key."""
        out: dict[str, float] = {}
        for token_id, lp in top:
            out.setdefault(self._token(token_id), lp)
        return out

    def _chat_logprobs(self, lps) -> dict:
        def entry(token_id: int, lp: float) -> dict:
            t = self._token(token_id)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(a, b) for a, b in x.top]}
                            for x in lps]}

    def _choice_body(self, prep: Prepared, c: Choice, text: str, lps, finish: str | None, delta: bool,
                     first: bool, offset: int = 0) -> dict:
        body = prep.body
        out: dict[str, Any] = {"index": c.index}
        if prep.chat:
            if delta:
                d: dict[str, Any] = {"role": "assistant", "content": text} if first else (
                    {"content": text} if text else {})
                out["delta"] = d
            else:
                out["message"] = {"role": "assistant", "content": text}
            out["logprobs"] = self._chat_logprobs(lps) if prep.logprobs is not None else None
        else:
            if body.echo and first:
                text = prep.echo_texts[c.prompt] + text
            out["text"] = text
            out["logprobs"] = self._completion_logprobs(lps, offset) if prep.logprobs is not None else None
        out["finish_reason"] = finish
        if body.return_token_ids:
            out["token_ids"] = list(c.token_ids) if not delta else None
        return out

    def _envelope(self, prep: Prepared, rid: str, chunk: bool) -> dict:
        kind = ("chat.completion" if prep.chat else "text_completion") + (".chunk" if chunk and prep.chat else "")
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.served.name}

    def _final(self, prep: Prepared, rid: str, choices: list[Choice]) -> dict:
        out = self._envelope(prep, rid, False)
        out["choices"] = [self._choice_body(prep, c, c.text, c.logprobs, c.finish, False, True) for c in choices]
        out["usage"] = self._usage(prep, choices)
        return out

    async def _sse(self, prep: Prepared, rid: str, choices: list[Choice], events, outcome: dict):
        include_usage = prep.body.stream_options is not None and prep.body.stream_options.include_usage
        failed = False
        try:
            async for got in events:  # one write per list: a step's events (or a lagging loop's backlog)
                parts = []
                for c, ev in got:
                    if ev.error is not None:
                        if not failed:
                            failed = True
                            outcome["outcome"] = "error"
                            err = {"message": f"generation failed: {ev.error}", "type": "server_error",
                                   "param": None, "code": None}
                            parts.append(f"data: {json.dumps({'error': err})}\n\n")
                        continue
                    chunk = self._envelope(prep, rid, True)
                    first = not c.started
                    c.started = True
                    offset = len(c.text) - len(ev.text)
                    body = self._choice_body(prep, c, ev.text, ev.logprobs, ev.finish_reason, True, first, offset)
                    if prep.body.return_token_ids:
                        body["token_ids"] = list(ev.token_ids)
                    chunk["choices"] = [body]
                    if include_usage:
                        chunk["usage"] = None
                    parts.append(f"data: {json.dumps(chunk)}\n\n")
                if all(c.finish is not None for c in choices):
                    if include_usage and not failed:
                        last = {**self._envelope(prep, rid, True), "choices": [],
                                "usage": self._usage(prep, choices)}
                        parts.append(f"data: {json.dumps(last)}\n\n")
                    parts.append("data: [DONE]\n\n")
                yield "".join(parts)
            if not failed and all(c.finish is not None for c in choices):
                await self._save(choices)
        finally:
            await events.aclose()  # a client that left: the live source's finally frees the slots now


def create_app(engine, cache=None, max_body_bytes: int = 1 << 20, read_timeout_s: float = 30.0) -> FastAPI:
    """The FastAPI app over a started-on-startup :class:`~moetrain.serve.engine.Engine`.

    Args:
        engine: the engine (started by the app's lifespan, stopped at shutdown).
        cache: a response cache (:mod:`moetrain.serve.cache`) or ``None``.
        max_body_bytes: largest accepted request body (413 beyond).
        read_timeout_s: seconds a request's body may take to arrive (408 beyond).
    Raises:
        ValueError: the served directory's chat template does not compile.
    """
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        if not engine.alive():
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    api = Api(engine, cache)
    app = FastAPI(title="moetrain serve", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    served, metrics = engine.served, engine.metrics
    app.state.count_outcome = lambda outcome: metrics.requests.labels(outcome).inc()
    app.add_middleware(RequestGuard, max_bytes=max_body_bytes, read_timeout_s=read_timeout_s,
                       count=app.state.count_outcome)

    @app.get("/health")
    async def health():
        if not engine.alive():
            return error(503, "engine not running", None, "server_error")
        running, waiting = engine.occupancy()
        return {"status": "ok", "model": served.name, "running": running, "waiting": waiting, "slots": engine.num_slots}

    @app.get("/metrics")
    async def prometheus():
        return Response(await asyncio.to_thread(metrics.render), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": api.created, "owned_by": "moetrain"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served.name:
            return error(404, f"The model `{model_id}` does not exist (this server serves `{served.name}`)",
                         "model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await api.handle(request, chat=True)

    return app
