"""The serving engine in a process of its own: how ``moetrain serve`` runs it on one process (expert-parallel
serving under torchrun keeps it in rank 0's process, beside the ranks it drives).

Why: the engine's step is hundreds of small PyTorch calls with Python between them, and the HTTP front (uvicorn,
JSON, tokenisation, response bodies) is Python as well. In one process they share one GIL and take turns on one
core: under 16 clients the server process used 1.0 core in all, the engine thread 88% of it and the front 12%, and
the engine's step took 4.4 ms instead of its 3.6 ms alone (cpu-small, AMD EPYC). With the engine in a child process
each has a core and an interpreter lock of its own. vLLM runs its ``EngineCore`` in a background process for the
same reason; the engine itself (:class:`~moetrain.serve.engine.Engine`) is the same class either way.

:class:`RemoteEngine` is the front's handle: the interface :mod:`moetrain.serve.api` uses of an engine (``submit``,
``cancel``, ``alive``, ``occupancy``, ``metrics``, the served model's tokenizer and identity). The child builds the
engine from a picklable callable (the model is loaded there only), then serves two kinds of messages over one
:func:`multiprocessing.Pipe` (pickled tuples):

- front -> engine: ``("submit", [(id, RequestSpec), ...])``, ``("cancel", id)``, the question ``("metrics", n)``
  and ``("stop",)``;
- engine -> front: ``("ready", EngineInfo)`` or ``("failed", message)`` once, then ``("events", [(id, Event), ...])``
  once per engine step that has events (the engine's own per-step batching, :meth:`Engine._flush`), and
  ``("reply", n, answer)`` for question n (a late answer to an earlier question is dropped).

``GET /metrics`` is the front's counters (request outcomes, response cache: :data:`FRONT_METRICS`) followed by the
engine's. If the child dies, every request in flight ends with an error event, :meth:`RemoteEngine.alive` is false
(``/health`` answers 503) and :attr:`RemoteEngine.exit_message` says how it ended (``moetrain serve`` then stops
with that error); the child ends when the front's end of the pipe closes.
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from multiprocessing.connection import Connection

from moetrain.errors import MoetrainError
from moetrain.model.sampling import SamplingParams
from moetrain.serve.engine import Engine, EngineStopped, Event, GenRequest, QueueFull, _deliver
from moetrain.serve.metrics import ServeMetrics
from moetrain.serve.routing import RoutingPolicy


@dataclass(frozen=True)
class RequestSpec:
    """What the engine needs of a :class:`GenRequest` (its callbacks stay in the front)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    policy: RoutingPolicy | None
    logprobs: int | None
    incremental: bool


@dataclass(frozen=True)
class EngineInfo:
    """What the front reads of the engine and its model, sent once by the child when the engine is built."""

    name: str
    fingerprint: str
    source: str
    root: str
    eos_id: int | None
    tokenizer_json: str
    vocab_size: int
    max_seq_len: int
    moe_shape: tuple[int, int] | None
    num_slots: int
    max_queue: int
    policy: RoutingPolicy
    int8_router: bool
    int8_experts: bool
    threads: int


@dataclass
class ServedInfo:
    """The front's view of the served model: the ``served`` attributes the API reads (no weights)."""

    name: str
    fingerprint: str
    source: str
    root: str
    eos_id: int | None
    tokenizer: object = field(repr=False)


class _Sink:
    """In the child: stands in for the requests' event loop (``GenRequest.loop``), so the engine's per-step
    :meth:`~moetrain.serve.engine.Engine._flush` sends the step's events to the front in one message."""

    def __init__(self, send: Callable[[tuple], None]):
        self.send = send
        self.ids: dict[GenRequest, str] = {}  # request -> the front's id, until its last event

    def call_soon_threadsafe(self, _fn, items) -> None:
        out = []
        for req, event in items:
            rid = self.ids.get(req)
            if event.finish_reason is not None:
                self.ids.pop(req, None)
            if rid is not None:
                out.append((rid, event))
        self.send(("events", out))


def _exit_status(proc: multiprocessing.process.BaseProcess) -> str:
    """How a child that closed its pipe ended: its exit code, or the signal that killed it."""
    proc.join(timeout=5)
    code = proc.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}" if code is not None else "still running"


def _ignore(_event: Event) -> None:  # the child's requests deliver through the sink, never through emit
    pass


def engine_main(build: Callable[[], Engine], conn) -> None:
    """The child process: build the engine, report it, start it and serve the front's messages until ``stop`` or
    until the front's end of the pipe closes."""
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:  # the engine thread (events) and this thread (metrics replies) both send
            try:
                conn.send(msg)
            except OSError:  # the front is gone (it exited or was killed): nobody to tell; this process ends next
                pass

    try:
        engine = build()
    except KeyboardInterrupt:
        return
    except BaseException as e:  # noqa: BLE001 - reported to the front, which raises it as the start-up error
        send(("failed", str(e) if isinstance(e, MoetrainError) else f"{type(e).__name__}: {e}"))
        return
    engine.metrics = ServeMetrics(scope="engine")  # the front exports the others (nothing is counted before start)
    served, cfg = engine.served, engine.model.config
    send(("ready", EngineInfo(served.name, served.fingerprint, served.source, served.root, served.eos_id,
                              served.tokenizer.to_str(), engine.vocab_size, cfg.max_seq_len, engine.moe_shape,
                              engine.num_slots, engine.max_queue, engine.policy, engine.int8_router,
                              engine.int8_experts is not None, engine.threads)))
    sink = _Sink(send)
    requests: dict[str, GenRequest] = {}
    engine.start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the front is gone
            if msg[0] == "submit":
                reqs = []
                for rid, s in msg[1]:
                    req = GenRequest(s.prompt_ids, s.max_tokens, _ignore, s.sampling, s.seed, s.stop, s.policy,
                                     s.logprobs, incremental=s.incremental, loop=sink)
                    sink.ids[req] = rid
                    requests[rid] = req
                    reqs.append(req)
                try:
                    engine.submit(*reqs)
                except (QueueFull, EngineStopped) as e:  # the front's count lagged: these requests end at once
                    for req in reqs:
                        sink.ids.pop(req, None)
                    send(("events", [(rid, Event("", (), "error", str(e))) for rid, _ in msg[1]]))
                for rid in [r for r, q in requests.items() if q not in sink.ids]:
                    del requests[rid]  # finished ones
            elif msg[0] == "cancel":
                gone = requests.pop(msg[1], None)
                if gone is not None:
                    engine.cancel(gone)
            elif msg[0] == "metrics":
                send(("reply", msg[1], engine.metrics.render()))
            elif msg[0] == "stop":
                break
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()


class RemoteEngine:
    """The front's handle on an :class:`~moetrain.serve.engine.Engine` running in a child process.

    Args:
        build: a picklable callable returning the engine (built in the child, which loads the model).
        start_timeout_s: seconds the child may take to load the model and build the engine.
    Raises:
        MoetrainError: from :meth:`start`: the child could not build the engine (its message), or died.
    """

    def __init__(self, build: Callable[[], Engine], start_timeout_s: float = 600.0):
        self._build, self.start_timeout_s = build, start_timeout_s
        self.metrics = ServeMetrics(scope="front")
        self.metrics.render = self._render  # type: ignore[method-assign]
        self._requests: dict[str, GenRequest] = {}
        self._ids: dict[GenRequest, str] = {}
        self._lock = threading.Lock()
        self._replies: queue.Queue = queue.Queue()
        self._call_lock = threading.Lock()
        self._next = self._next_call = 0
        self.exit_message: str | None = None  # why the child ended, when it ended without being stopped
        self.call_timeout_s = 10.0  # how long /metrics waits for the engine's figures
        self._stopped = False
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def start(self) -> None:
        """Start the child and wait until its engine runs (loading the model happens there)."""
        if self._proc is not None:
            return
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads and OpenMP pools
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=engine_main, args=(self._build, child), name="moetrain-engine", daemon=True)
        self._conn, self._proc = conn, proc
        proc.start()
        child.close()
        if not conn.poll(self.start_timeout_s):
            proc.kill()
            raise MoetrainError(f"the engine process did not start within {self.start_timeout_s:g} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise MoetrainError(f"the engine process exited while starting ({_exit_status(proc)})") from None
        if kind == "failed":
            proc.join(timeout=10)
            raise MoetrainError(payload)
        info: EngineInfo = payload
        from tokenizers import Tokenizer

        self.served = ServedInfo(info.name, info.fingerprint, info.source, info.root, info.eos_id,
                                 Tokenizer.from_str(info.tokenizer_json))
        self.vocab_size, self.max_seq_len, self.moe_shape = info.vocab_size, info.max_seq_len, info.moe_shape
        self.num_slots, self.max_queue, self.policy = info.num_slots, info.max_queue, info.policy
        self.int8_router, self.int8_experts = info.int8_router, (True if info.int8_experts else None)
        self.threads = info.threads
        threading.Thread(target=self._read, name="moetrain-engine-reader", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        if self._proc is None:
            return
        try:
            self._send(("stop",))
        except (OSError, ValueError):
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and not self._stopped

    def occupancy(self) -> tuple[int, int]:
        """(running, waiting) requests as this front counts them (those it submitted and has not seen end): never a
        round trip, so ``/health`` answers at once even when the engine is busy or stuck."""
        with self._lock:
            n = len(self._requests)
        return min(n, self.num_slots), max(0, n - self.num_slots)

    def _metrics_call(self) -> bytes:
        """The engine's metrics text; empty when it is gone or does not answer within :attr:`call_timeout_s`. Each
        question carries a number and its answer the same, so a late answer to an earlier question is never taken
        for this one's."""
        with self._call_lock:
            if not self.alive():
                return b""
            self._next_call += 1
            with self._lock:
                self._send(("metrics", self._next_call))
            deadline = time.monotonic() + self.call_timeout_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    number, answer = self._replies.get(timeout=left)
                except queue.Empty:
                    break
                if number == self._next_call:
                    return answer
            return b""

    def submit(self, *reqs: GenRequest) -> None:
        """As :meth:`Engine.submit`. The queue bound is applied here from the requests in flight (those beyond the
        slots wait), so that a full queue is a 429 at once rather than after a round trip."""
        with self._lock:
            if not self.alive():
                raise EngineStopped("the engine is not running")
            waiting = max(0, len(self._requests) - self.num_slots)
            if waiting + len(reqs) > self.max_queue:
                raise QueueFull(f"{waiting} requests already waiting (--max-queue {self.max_queue})")
            specs = []
            for req in reqs:
                rid, self._next = str(self._next), self._next + 1
                self._requests[rid], self._ids[req] = req, rid
                specs.append((rid, RequestSpec(req.prompt_ids, req.max_tokens, req.sampling, req.seed, req.stop,
                                               req.policy, req.logprobs, req.incremental)))
            self._send(("submit", specs))

    def cancel(self, req: GenRequest) -> None:
        with self._lock:
            rid = self._ids.pop(req, None)
            if rid is None:
                return
            self._requests.pop(rid, None)
            req.cancelled = True
            self._send(("cancel", rid))

    def _send(self, msg: tuple) -> None:
        assert self._conn is not None
        self._conn.send(msg)

    def _read(self) -> None:
        """The reader thread: hand each step's events to their requests' event loops, one call per loop."""
        assert self._conn is not None
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "reply":
                self._replies.put((msg[1], msg[2]))
                continue
            items = msg[1]
            by_loop: dict = {}
            with self._lock:
                for rid, event in items:
                    req = self._requests.get(rid)
                    if req is None:
                        continue  # cancelled
                    if event.finish_reason is not None:
                        req.finish_reason = event.finish_reason
                        del self._requests[rid]
                        self._ids.pop(req, None)
                    by_loop.setdefault(req.loop, []).append((req, event))
            for loop, got in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_deliver, got)
                except RuntimeError:  # the loop is closed: nobody listens
                    pass
        if not self._stopped:
            assert self._proc is not None
            self.exit_message = f"the engine process exited ({_exit_status(self._proc)})"
        self._stopped = True
        with self._lock:
            left, self._requests, self._ids = list(self._requests.values()), {}, {}
        for req in left:  # the child died: end what was in flight
            event, loop = Event("", (), "error", "the engine process exited"), cast(Any, req.loop)
            try:
                loop.call_soon_threadsafe(_deliver, [(req, event)])
            except (RuntimeError, AttributeError):
                pass

    def _render(self) -> bytes:
        """The front's counters and the engine's (asked of the child; only the front's if it does not answer)."""
        return ServeMetrics.render(self.metrics) + self._metrics_call()
