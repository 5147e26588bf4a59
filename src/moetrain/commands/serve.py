"""``moetrain serve RUN_DIR|HF_DIR``: an OpenAI-compatible completions server with continuous batching
(moetrain/serve/, docs/serving.md)."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

from moetrain.commands import check_at_least
from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a run or HF directory over HTTP (OpenAI-compatible: completions, chat "
                       "completions, models)")
    p.add_argument("model_dir", help="a moetrain run directory, or a Hugging Face directory (moetrain export/upcycle)")
    p.add_argument("overrides", nargs="*", metavar="parallel.FIELD=VALUE",
                   help="expert-parallel serving under torchrun: parallel.ep=N (and parallel.timeout_s, "
                   "parallel.backend); rank 0 serves HTTP")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port; the bound one is printed)")
    p.add_argument("--slots", type=int, default=16, help="sequences decoded together (KV-cache slots)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    p.add_argument("--routing", choices=["fixed", "threshold", "load"], default="fixed",
                   help="server routing policy (dynamic top-k; requests may override with a `routing` field)")
    p.add_argument("--top-k", type=int, default=None, help="fixed: experts per token (default: the trained k)")
    p.add_argument("--threshold", type=float, default=None, help="threshold: probability mass p to reach "
                   "(default 0.9)")
    p.add_argument("--k-min", type=int, default=None, help="threshold/load: fewest experts per token (default 1)")
    p.add_argument("--k-max", type=int, default=None, help="threshold/load: most experts (default: trained k)")
    p.add_argument("--load-low", type=int, default=None, help="load: queue depth where k starts to fall "
                   "(default: --slots / 2)")
    p.add_argument("--load-high", type=int, default=None, help="load: queue depth where k reaches k_min "
                   "(default: 2 x --slots)")
    p.add_argument("--int8-router", action="store_true", help="route with int8 router weights (per-row scale)")
    p.add_argument("--int8-experts", action="store_true",
                   help="routed experts as int8 weight-only copies (per-output-row scale, dequantised on use; "
                   "about 0.26 of their fp32 bytes)")
    p.add_argument("--expert-memory-budget", default=None, metavar="BYTES",
                   help="most bytes of routed experts resident (e.g. 64M or 64MiB = 64*2^20, 64MB = 64*10^6); hot "
                   "experts stay, cold ones are paged in from the memory-mapped safetensors file through an LRU "
                   "(default: all resident)")
    p.add_argument("--hot-share", type=float, default=None,
                   help="share of --expert-memory-budget pinned for the hottest experts (the rest is the LRU pool; "
                   "default 0.5)")
    p.add_argument("--calibration-text", default=None, metavar="FILE",
                   help="rank experts by a calibration pass over this text (default: the run's routing statistics "
                   "in metrics.jsonl, else uniform)")
    p.add_argument("--placement", default=None, metavar="FILE",
                   help="expert-parallel serving: the expert-to-rank map written by `moetrain placement --ep N` "
                   "(placement-epN-rR.json; hot experts replicated); needs parallel.ep=N")
    p.add_argument("--cache", default="memory", help="response cache: memory (LRU), memory:N, off, or "
                   "redis://HOST:PORT[/DB] (shared by several servers)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    p.add_argument("--max-connections", type=int, default=512,
                   help="most open connections; one more is answered 503 with Retry-After and closed")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a request's headers may take to arrive (408 and closed beyond)")
    p.add_argument("--read-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request's body may take to arrive (408 beyond)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: the usable cores "
                   "less one, kept for the HTTP front; at least 1)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request; the bound address is printed at any level)")
    p.set_defaults(func=run)


# RoutingPolicy field -> the serve flag that sets it
POLICY_FLAGS = {"k": "--top-k", "p": "--threshold", "k_min": "--k-min", "k_max": "--k-max", "low": "--load-low",
                "high": "--load-high"}


def _flag_error(e: ValueError) -> MoetrainError:
    """A RoutingPolicy error ``"FIELD: ..."`` (or ``"low/high: ..."``) as one naming the flags."""
    field, _, rest = str(e).partition(": ")
    return MoetrainError(f"{'/'.join(POLICY_FLAGS.get(f, f) for f in field.split('/'))}: {rest}")


def policy_from_args(args):
    """The server's :class:`~moetrain.serve.routing.RoutingPolicy` from the routing flags.

    Raises:
        MoetrainError: a value out of range, or a flag that ``--routing`` does not read (it would do nothing).
    """
    from moetrain.serve.routing import RoutingPolicy, check_fields

    given = {f: v for f, flag in POLICY_FLAGS.items() if (v := getattr(args, flag[2:].replace("-", "_"))) is not None}
    try:
        check_fields(args.routing, given)  # a flag this policy does not read would do nothing
    except ValueError as e:
        raise _flag_error(e) from None
    low = given.pop("low", max(1, args.slots // 2))
    high = given.pop("high", max(low + 1, 2 * args.slots))
    try:
        return RoutingPolicy(policy=args.routing, low=low, high=high, **given)
    except ValueError as e:
        raise _flag_error(e) from None


MAX_THREADS = 1024


def check_args(args) -> None:
    """The flags' own errors, before anything is loaded.

    Raises:
        MoetrainError: naming the flag and value.
    """
    check_at_least(args, 1, "slots", "max_queue", "max_body_bytes", "threads", "max_connections")
    for name in ("header_timeout", "read_timeout"):
        value = getattr(args, name)
        if not 0 < value < float("inf"):
            raise MoetrainError(f"--{name.replace('_', '-')}: must be a positive number of seconds, got {value}")
    if args.threads is not None and args.threads > MAX_THREADS:  # torch.set_num_threads crashes on huge counts
        raise MoetrainError(f"--threads: at most {MAX_THREADS}, got {args.threads}")
    if not 0 <= args.port <= 65535:
        raise MoetrainError(f"--port: must be in [0, 65535] (0: any free port), got {args.port}")
    if args.expert_memory_budget is None:
        for flag, value in (("--hot-share", args.hot_share), ("--calibration-text", args.calibration_text)):
            if value is not None:
                raise MoetrainError(f"{flag}: only with --expert-memory-budget (it ranks the experts kept resident)")
    if args.int8_experts and args.expert_memory_budget is not None:
        raise MoetrainError("--int8-experts: not with --expert-memory-budget (choose one way to shrink the experts)")


def build_engine(args, mesh=None):
    """The :class:`~moetrain.serve.engine.Engine` of parsed arguments (loads the model; sets the intra-op threads).
    With an expert-parallel ``mesh`` (serve/expert_parallel.py) the experts are sharded over its ranks; on ranks
    other than 0 the engine only lends its step runner to :func:`moetrain.serve.expert_parallel.follow`.

    Raises:
        MoetrainError: a flag that does not fit the model, or the loaders' errors.
    """
    import torch

    from moetrain.runtime.threads import serving_threads
    from moetrain.serve.engine import Engine
    from moetrain.serve.loader import load_served_model

    torch.set_num_threads(args.threads if args.threads is not None else serving_threads())
    policy = policy_from_args(args)
    served = load_served_model(args.model_dir)
    if served.model.moe_layers():
        c = served.model.moe_layers()[0].config
        try:
            policy.bounds(c.top_k, c.num_experts)
        except ValueError as e:
            raise _flag_error(e) from None
    if mesh is not None:
        from moetrain.serve.expert_parallel import HEARTBEAT_S, BroadcastRunner, parallel_config, shard_for_serving

        shard_for_serving(served.model, mesh, read_placement(args, served, mesh.ep))  # the EP dispatchers
        engine = Engine(served, num_slots=args.slots, max_queue=args.max_queue, policy=policy,
                        int8_router=args.int8_router)
        if mesh.rank != 0:
            return engine
        engine.runner = engine.peers = BroadcastRunner(engine.runner, mesh)
        # a heartbeat well within the collectives' time-out, so idle followers never time out
        engine.idle_s = min(HEARTBEAT_S, parallel_config(list(args.overrides)).timeout_s / 4)
        return engine
    if args.placement is not None:
        raise MoetrainError(f"--placement: {args.placement} places experts over EP ranks; serve it with torchrun "
                            "--nproc_per_node N -m moetrain serve ... parallel.ep=N")
    if args.int8_experts and not served.model.moe_layers():
        raise MoetrainError("--int8-experts: the model has no MoE layers")
    engine = Engine(served, num_slots=args.slots, max_queue=args.max_queue, policy=policy,
                    int8_router=args.int8_router, expert_store=open_store(args, served), int8_experts=args.int8_experts)
    if engine.int8_experts is not None:
        engine.int8_experts.release_fp32()
        print(f"moetrain serve: int8 experts, {engine.int8_experts.nbytes():,} bytes (fp32: "
              f"{engine.int8_experts.fp32_bytes:,})", file=sys.stderr)
    return engine


def build_app(args, mesh=None):
    """(app, engine) from parsed arguments; the model is loaded, the engine running.

    On one process the engine runs in a child process of its own
    (:class:`~moetrain.serve.engine_process.RemoteEngine`: the HTTP front and the engine's steps then each have a
    core and an interpreter lock). With an expert-parallel ``mesh`` it runs in this process, rank 0 driving the
    others; the app is ``None`` on ranks other than 0.

    Raises:
        MoetrainError: :func:`check_args`' and :func:`build_engine`'s errors.
    """
    import functools

    from moetrain.serve.api import create_app
    from moetrain.serve.cache import open_cache

    check_args(args)
    if mesh is None or mesh.rank == 0:  # the rank that serves HTTP
        check_address(args.host, args.port)
    cache = open_cache(args.cache)
    if mesh is not None:
        engine = build_engine(args, mesh)
        if mesh.rank != 0:
            return None, engine
    else:
        from moetrain.serve.engine_process import RemoteEngine

        engine = RemoteEngine(functools.partial(build_engine, args))
        engine.start()
    return create_app(engine, cache, args.max_body_bytes, args.read_timeout), engine


def limits_from_args(args):
    """The server's connection :class:`~moetrain.serve.server.Limits` from the flags."""
    from moetrain.serve.server import Limits

    return Limits(args.max_connections, args.header_timeout)


def expert_parallel_mesh(args):
    """The EP mesh asked for by ``parallel.ep=N`` under torchrun, or ``None`` for one process.

    Raises:
        MoetrainError: bad overrides, world size different from ``ep``, or combined with
            ``--expert-memory-budget``.
    """
    import os

    from moetrain.serve.expert_parallel import parallel_config

    cfg = parallel_config(list(getattr(args, "overrides", None) or []))
    if cfg.ep == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.ep:
        raise MoetrainError(f"parallel.ep: serve needs one process per EP rank; ep={cfg.ep} but WORLD_SIZE={world} "
                            f"(torchrun --nproc_per_node {cfg.ep} -m moetrain serve ... parallel.ep={cfg.ep})")
    if getattr(args, "expert_memory_budget", None) is not None:
        raise MoetrainError("--expert-memory-budget: not available with parallel.ep > 1 (each rank already holds "
                            "only its E / ep experts)")
    if getattr(args, "int8_experts", False):
        raise MoetrainError("--int8-experts: not available with parallel.ep > 1 yet")
    from moetrain.parallel.layout import init_layout_mesh

    return init_layout_mesh(cfg, "cpu")[0].ep_mesh


def read_placement(args, served, ep: int):
    """The MoE block -> :class:`~moetrain.serve.placement.LayerPlacement` map of ``--placement FILE`` checked
    against the model and ``ep``, or ``None`` without the flag.

    Raises:
        MoetrainError: the file's own errors (:func:`~moetrain.serve.placement.load_placement`), naming it.
    """
    if args.placement is None:
        return None
    from moetrain.serve.placement import load_placement

    blocks, e = moe_blocks(served, f"--placement: {args.placement}")
    return load_placement(args.placement, blocks, e, ep)


def moe_blocks(served, flag: str) -> tuple[list[int], int]:
    """The MoE blocks of a served model and their experts per layer E; a MoetrainError naming ``flag`` without."""
    blocks = [i for i, b in enumerate(served.model.blocks) if b.is_moe]
    if not blocks:
        raise MoetrainError(f"{flag}: the model has no MoE layers")
    return blocks, served.model.blocks[blocks[0]].ffn.config.num_experts


def calibration_usage(args, served):
    """The expert usage to rank or place experts by (:func:`moetrain.serve.expert_usage.served_usage`) from
    ``--calibration-text FILE`` (a MoetrainError when unreadable), else from the run's routing statistics."""
    from moetrain.serve.expert_usage import served_usage

    text = None
    if args.calibration_text is not None:
        try:
            text = Path(args.calibration_text).read_text()
        except OSError as e:
            raise MoetrainError(f"--calibration-text: {e}") from None
    return served_usage(served, text, name=f"--calibration-text {args.calibration_text}")


def open_store(args, served):
    """The hot/cold :class:`~moetrain.serve.expert_store.ExpertStore` asked for by ``--expert-memory-budget``, or
    ``None``."""
    budget = args.expert_memory_budget
    if budget is None:
        return None
    from moetrain.configlib import parse_size
    from moetrain.serve.expert_store import ExpertStore, routed_expert_bytes

    n = parse_size(budget, "--expert-memory-budget")
    moe_blocks(served, "--expert-memory-budget")
    usage = calibration_usage(args, served)
    total = routed_expert_bytes(served.model)
    hot_share = 0.5 if args.hot_share is None else args.hot_share
    store = ExpertStore(served.model, n, usage, served.experts_file(), hot_share=hot_share)
    print(f"moetrain serve: expert memory budget {n:,} of {total:,} bytes ({100 * n / total:.0f}%), "
          f"{len(store.pinned)} hot experts pinned, {len(store.pool)} in the LRU pool; usage from {usage.source}",
          file=sys.stderr)
    return store


def check_address(host: str, port: int) -> None:
    """Fail before the model loads when ``host:port`` cannot be bound (taken, or not this machine's): uvicorn would
    say so only after. A port taken in between is still uvicorn's error.

    Raises:
        MoetrainError: naming ``--host`` / ``--port`` and the system's reason.
    """
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as e:
            raise MoetrainError(f"--host {host} --port {port}: {e.strerror or e}") from None


def run(args) -> int:
    mesh = expert_parallel_mesh(args)
    app, engine = build_app(args, mesh)
    if mesh is not None and mesh.rank != 0:
        from moetrain.serve.expert_parallel import follow

        follow(engine.runner, mesh)
        return 0
    from moetrain.serve.server import BackgroundServer

    ep = f", experts over {mesh.ep} processes (parallel.ep)" if mesh is not None else ""
    if mesh is not None and args.placement is not None:
        ep += f" placed by {args.placement}"
    print(f"moetrain serve: {engine.served.name} ({engine.served.source}), {args.slots} slots, routing "
          f"{engine.policy.policy}, cache {args.cache}, {engine.threads} intra-op threads{ep}",
          file=sys.stderr)
    server = BackgroundServer(app, args.host, args.port, log_level=args.log_level,
                              limits=limits_from_args(args))
    try:
        server.start()
    except RuntimeError as e:
        raise MoetrainError(f"--host {args.host} --port {args.port}: {e}") from None
    # SIGTERM (docker stop, systemd, Kubernetes) shuts down as Ctrl+C does: uvicorn runs in a thread here, so its own
    # handler is not installed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"moetrain serve: running on {server.url} (Ctrl+C to stop)", file=sys.stderr, flush=True)
    try:
        while server.thread.is_alive() and engine.alive():
            server.thread.join(timeout=0.5)
    except KeyboardInterrupt:
        server.stop()
        engine.stop()
        raise
    server.stop()
    if not engine.alive():  # the engine died: stop serving 503s, so that a supervisor restarts the server
        engine.stop()
        raise MoetrainError(f"stopped: {getattr(engine, 'exit_message', None) or 'the engine stopped'}")
    return 0
