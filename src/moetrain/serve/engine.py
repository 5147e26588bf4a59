"""The continuous-batching engine: a bounded queue, a fixed set of KV-cache slots, and one loop (its own thread)
that steps every running sequence together.

Each loop iteration is a step boundary: cancelled sequences (a client that went away) free their slots, waiting
requests are admitted into free slots, and one :meth:`StepRunner.step` runs the new prompts (prefill) and every
decoding sequence's last token (decode) as one batch; each sequence then samples its next token, streams its new
text, and is released when it finishes (end-of-text token, ``max_tokens`` or a stop string).
"""

from __future__ import annotations

import collections
import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moetrain.serve.forward import StepBatch, StepRunner
from moetrain.model.attention import KVCache
from moetrain.serve.metrics import ServeMetrics
from moetrain.serve.moe import StepPolicies
from moetrain.serve.routing import RoutingPolicy
from moetrain.model.sampling import SamplingError, SamplingParams, sample_rows, token_logprobs


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests (HTTP 429)."""


class EngineStopped(Exception):
    """The engine is not running (HTTP 503)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model and the most likely alternatives ((id, logprob), most
    likely first; see :func:`moetrain.model.sampling.token_logprobs`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Event:
    """What a request receives after a step: ``text`` (new text), ``token_ids`` (new tokens), their ``logprobs``
    (when the request asked for them) and, on the last event, ``finish_reason`` (``stop`` or ``length``; ``error``
    with ``error`` set when the step or this request's sampling failed)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


GREEDY = SamplingParams(temperature=0.0)


@dataclass(eq=False)
class GenRequest:
    """One completion being served. ``emit`` is called from the engine thread with each :class:`Event`."""

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    sampling: SamplingParams = GREEDY
    seed: int | None = None
    stop: tuple[str, ...] = ()
    policy: RoutingPolicy | None = None  # None: the server's
    logprobs: int | None = None  # report each token's logprob and this many alternatives; None: no logprobs
    out_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0  # positions in the KV cache
    cancelled: bool = False
    finish_reason: str | None = None
    sent: int = 0  # characters of the completion text already emitted
    generator: torch.Generator | None = None
    admitted_at: float = 0.0
    incremental: bool = True  # an event per token (streaming); False: one event with the whole completion
    loop: object = None  # an asyncio loop: then ``emit`` is called on it (batched per step), not on this thread
    token_logprobs: list[TokenLogprob] = field(default_factory=list)


class Engine:
    """Continuous batching over ``num_slots`` KV-cache slots.

    Args:
        served: a :class:`~moetrain.serve.loader.ServedModel`.
        num_slots: most sequences decoded together (each owns a [max_seq_len] KV block per layer).
        max_queue: most requests waiting for a slot; :meth:`submit` raises :class:`QueueFull` beyond.
        policy: the server's routing policy (requests may bring their own).
        metrics: where to count; a fresh :class:`ServeMetrics` if ``None``.
        int8_router: route with int8 router weights (:class:`~moetrain.serve.routing.Int8Router`).
        experts_fn: the routed-experts computation (default: the layers' own kernels).
        expert_store: a :class:`~moetrain.serve.expert_store.ExpertStore` computing the routed experts under its
            memory budget (overrides ``experts_fn``); its page-ins and resident bytes are exported as metrics.
        int8_experts: compute the routed experts from int8 weight-only copies
            (:class:`~moetrain.serve.quant_experts.Int8Experts`, kept as ``self.int8_experts``; overrides
            ``experts_fn``; the model's fp32 experts stay unless the caller releases them).
        max_prefill_tokens: prompt tokens prefilled per step at most (at least one prompt always is), so a burst
            of long prompts does not stall decoding sequences for long.
    """

    def __init__(self, served, num_slots: int = 16, max_queue: int = 64, policy: RoutingPolicy | None = None,
                 metrics: ServeMetrics | None = None, int8_router: bool = False, experts_fn=None,
                 max_prefill_tokens: int = 2048, expert_store=None, int8_experts: bool = False):
        from moetrain.serve.routing import Int8Router

        self.served, self.model = served, served.model
        cfg = self.model.config
        self.max_seq_len = cfg.max_seq_len
        self.num_slots, self.max_queue, self.max_prefill_tokens = num_slots, max_queue, max_prefill_tokens
        self.policy = policy or RoutingPolicy()
        self.int8_router = int8_router
        self.metrics = metrics or ServeMetrics()
        self.cache = KVCache(cfg.n_layers, num_slots, cfg.max_seq_len)
        self.moe_blocks = [i for i, b in enumerate(self.model.blocks) if b.is_moe]
        self.vocab_size, self.threads = cfg.vocab_size, torch.get_num_threads()
        first = self.model.blocks[self.moe_blocks[0]].ffn.config if self.moe_blocks else None
        # (K, E) of the MoE layers: what a routing policy is checked against and the load policy's k computed from
        self.moe_shape = (first.top_k, first.num_experts) if first is not None else None
        routers = {i: Int8Router(self.model.blocks[i].ffn.router.weight) for i in self.moe_blocks} if int8_router \
            else {}
        self.expert_store = expert_store
        if expert_store is not None:
            experts_fn = expert_store.experts_forward
        self.int8_experts = None
        if int8_experts:
            if expert_store is not None:
                raise ValueError("int8_experts: not with an expert store (--expert-memory-budget)")
            from moetrain.serve.quant_experts import Int8Experts

            self.int8_experts = Int8Experts(self.model)
            experts_fn = self.int8_experts.experts_forward
        self.runner = StepRunner(self.model, self.cache, routers, experts_fn)
        self._pageins = 0
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.running: list[GenRequest] = []
        self.free_slots = list(range(num_slots))[::-1]
        self.cond = threading.Condition()
        self.steps = 0
        self.last_load_k: int | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._seeds = random.Random()
        self._pending: list = []
        self._load_counters: dict[tuple[int, int], object] = {}
        # expert-parallel serving (serve/expert_parallel.py): the other ranks follow this engine's steps; this
        # thread sends them a heartbeat when idle for idle_s seconds and a stop when it ends (the only thread
        # that talks to them, so messages keep their order)
        self.peers = None
        self.idle_s = 10.0

    # --- public, any thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="moetrain-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def submit(self, *reqs: GenRequest) -> None:
        """Queue ``reqs`` (all or none: the ``n`` choices of one completion). Raises :class:`QueueFull` or
        :class:`EngineStopped`."""
        with self.cond:
            if not self.alive():
                raise EngineStopped("the engine is not running")
            # requests beyond the slots wait (a cancelled one leaves at the next step, one just queued is admitted
            # there): the count RemoteEngine keeps as well, so the two never disagree
            in_flight = sum(not r.cancelled for r in itertools.chain(self.running, self.waiting))
            waiting = max(0, in_flight - self.num_slots)
            if waiting + len(reqs) > self.max_queue:
                raise QueueFull(f"{waiting} requests already waiting (--max-queue {self.max_queue})")
            for req in reqs:
                seed = req.seed if req.seed is not None else self._seeds.getrandbits(63)
                req.generator = None if req.sampling.greedy else torch.Generator().manual_seed(seed)
                self.waiting.append(req)
            self.metrics.queue_depth.set(len(self.waiting))
            self.cond.notify_all()

    def cancel(self, req: GenRequest) -> None:
        """Drop ``req`` (waiting or running) at the next step boundary; its slot is freed."""
        with self.cond:
            req.cancelled = True
            self.cond.notify_all()

    def occupancy(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.running), len(self.waiting)

    def depth(self) -> int:
        """Queue depth seen by the ``load`` policy: waiting + running requests."""
        return len(self.waiting) + len(self.running)

    # --- engine thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self.cond:
                self._admit()
                while not self.running and not self._stop:
                    woken = self.cond.wait(timeout=self.idle_s if self.peers is not None else None)
                    if not woken and self.peers is not None and not self._stop:
                        self.peers.heartbeat()
                    self._admit()
                if self._stop:
                    break
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - a failed step ends its requests, not the server
                for req in self.running:
                    self._emit(req, Event("", (), "error", f"{type(e).__name__}: {e}"))
                    self._release(req)
                self.running = []
                self._flush()
        for req in [*self.running, *self.waiting]:
            self._emit(req, Event("", (), "error", "server shutting down"))
        self._flush()
        if self.peers is not None:
            self.peers.stop()

    def _admit(self) -> None:
        """Under the lock: free the slots of cancelled sequences, move waiting requests into free slots."""
        for req in [r for r in self.running if r.cancelled]:
            self.running.remove(req)
            self._release(req)
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot, req.admitted_at = self.free_slots.pop(), time.perf_counter()
            self.running.append(req)
        self.metrics.queue_depth.set(len(self.waiting))
        self.metrics.running.set(len(self.running))

    def _release(self, req: GenRequest) -> None:
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None

    def _plan(self) -> list[GenRequest]:
        """The step's sequences: every decoding one, and prompts to prefill up to ``max_prefill_tokens``.

        Decoding sequences come first, in slot order: they attend in one SDPA call whose keys are a view of the
        cache when their slots are consecutive (a gather of every layer's keys and values otherwise)."""
        prefill, budget = [], self.max_prefill_tokens
        for req in self.running:
            if req.cached == 0:
                if budget < len(req.prompt_ids) and budget < self.max_prefill_tokens:
                    continue  # waits for the next step (holding its slot)
                budget -= len(req.prompt_ids)
                prefill.append(req)
        return sorted((r for r in self.running if r.cached), key=lambda r: r.slot or 0) + prefill

    def _step(self) -> None:
        t0 = time.perf_counter()
        self.steps += 1  # counted before any token is emitted, so a client that got its answer sees its steps
        plan = self._plan()
        seqs = [(r.slot or 0, r.cached,  # a running request always holds a slot
                  r.prompt_ids if r.cached == 0 else [r.out_ids[-1]]) for r in plan]
        batch = StepBatch.build(seqs)
        depth = self.depth()
        segments = tuple((r.policy or self.policy, len(s[2])) for r, s in zip(plan, seqs))
        logits, stats = self.runner.step(batch, StepPolicies(segments, depth))
        nxt = sample_rows(logits, [r.sampling for r in plan], [r.generator for r in plan], [r.out_ids for r in plan])
        self._logprobs(plan, logits, nxt)
        prompt_tokens = 0
        for req, (_, _, toks), tok in zip(plan, seqs, nxt):
            if req.cached == 0:
                prompt_tokens += len(toks)
            req.cached += len(toks)
            if isinstance(tok, SamplingError):  # this request's own error; the others go on
                req.finish_reason = "error"
                self._emit(req, Event("", (), "error", f"sampling failed: {tok}"))
                continue
            req.out_ids.append(tok)
            self._advance(req)
        if prompt_tokens:
            self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generated_tokens.inc(len(plan))
        with self.cond:  # released before their last events go out: a client that got its answer sees its slot free
            for req in [r for r in self.running if r.finish_reason is not None]:
                self.running.remove(req)
                self._release(req)
                if req.finish_reason != "error":
                    self.metrics.latency.observe(time.perf_counter() - req.admitted_at)
            self.metrics.running.set(len(self.running))
        self._flush()
        self._record(plan, batch, stats, depth, time.perf_counter() - t0)

    def _logprobs(self, plan: list[GenRequest], logits: torch.Tensor, nxt: list) -> None:
        """Append each sampled token's :class:`TokenLogprob` to the requests that asked for logprobs."""
        rows = [j for j, r in enumerate(plan) if r.logprobs is not None and not isinstance(nxt[j], SamplingError)]
        if not rows:
            return
        top = max(plan[j].logprobs or 0 for j in rows)
        for j, (lp, alts) in zip(rows, token_logprobs(logits[rows], [nxt[j] for j in rows], top)):
            plan[j].token_logprobs.append(TokenLogprob(nxt[j], lp, tuple(alts[:plan[j].logprobs])))

    def _advance(self, req: GenRequest) -> None:
        """After ``req`` got a token: find its end (eos, length, stop string) and emit its new text."""
        if self.served.eos_id is not None and req.out_ids[-1] == self.served.eos_id:
            req.finish_reason = "stop"
        elif len(req.out_ids) >= req.max_tokens:
            req.finish_reason = "length"
        if not req.incremental and not req.stop and req.finish_reason is None:
            return  # nothing to look for in the text and nobody to stream it to: decoded once, at the end
        text = self.served.tokenizer.decode(req.out_ids)
        hits = [i for i in (text.find(s) for s in req.stop) if i >= 0]
        if hits:
            text, req.finish_reason = text[:min(hits)], "stop"
        end = len(text)
        if req.finish_reason is None:
            if req.stop:  # hold back what may be the start of a stop string
                end -= max(len(s) for s in req.stop) - 1
            while end > 0 and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence: wait for its bytes
                end -= 1
        if not req.incremental and req.finish_reason is None:
            return  # a non-streaming client waits for the whole completion: one event at the end
        delta = text[req.sent:end] if end > req.sent else ""
        req.sent = max(req.sent, end)
        ids = (req.out_ids[-1],) if req.incremental else tuple(req.out_ids)
        lps = tuple(req.token_logprobs[-len(ids):]) if req.logprobs is not None else ()
        self._emit(req, Event(delta, ids, req.finish_reason, logprobs=lps))

    def _emit(self, req: GenRequest, event: Event) -> None:
        if req.loop is not None:  # delivered with the step's others, see _flush
            self._pending.append((req, event))
            return
        try:
            req.emit(event)
        except RuntimeError:  # the client's event loop is gone: nobody listens
            req.cancelled = True

    def _flush(self) -> None:
        """Deliver the step's events: one ``call_soon_threadsafe`` per event loop for all of its requests (one
        wake-up of the HTTP thread per step, not one per sequence: it needs the GIL that this thread holds)."""
        pending, self._pending = self._pending, []
        by_loop: dict = {}
        for req, event in pending:
            by_loop.setdefault(req.loop, []).append((req, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody listens
                for req, _ in items:
                    req.cancelled = True

    def _expert_load(self, block: int, expert: int):
        """The ``expert_load`` counter of (block, expert), looked up once (a label lookup per expert per step cost
        more than the count)."""
        key = (block, expert)
        child = self._load_counters.get(key)
        if child is None:
            child = self._load_counters[key] = self.metrics.expert_load.labels(str(block), str(expert))
        return child

    def _record(self, plan, batch, stats, depth: int, seconds: float) -> None:
        m = self.metrics
        m.batch_size.observe(len(plan))
        m.step_seconds.observe(seconds)
        n = int(batch.input_ids.shape[0])
        if stats:
            active = sum(s.active for s in stats)
            m.assignments.inc(active)
            m.routed_tokens.inc(n * len(stats))
            m.active_experts.set(active / (n * len(stats)))
            counts = torch.stack([s.counts for s in stats]).tolist()  # [L][E]: one host copy for all layers
            for block, row in zip(self.moe_blocks, counts):
                for e, c in enumerate(row):
                    if c:
                        self._expert_load(block, e).inc(c)
        if self.expert_store is not None:
            st = self.expert_store.stats
            m.expert_pageins.inc(st.misses - self._pageins)
            self._pageins = st.misses
            m.expert_resident_bytes.set(self.expert_store.measure())
        if self.policy.policy == "load" and self.moe_shape is not None:
            self.last_load_k = self.policy.load_k(*self.moe_shape, depth)
            m.load_top_k.set(self.last_load_k)


def _deliver(items) -> None:
    """On the requests' event loop: hand each its event."""
    for req, event in items:
        req.emit(event)


_ids = itertools.count()


def next_request_id() -> str:
    return f"cmpl-{next(_ids)}-{random.getrandbits(32):08x}"
