"""Plain data parallelism (2 replicas) and FSDP2 sharding (``parallel.dp_shard=2``, ZeRO-3 and ZeRO-2) on 2 gloo
ranks, all on the one engine every ``torchrun`` job runs on, against a hand-written reference (the whole model on
each rank, one flat all-reduce of all gradients after backward: the least a replica's step can communicate), and
how much of FSDP2's reduce-scatter time overlaps backward.

``python benchmarks/fsdp_vs_allreduce.py [--rounds 7] [--steps 8] [--layers 4] [--grad-accum 1] [--trace f.json]``

Both ranks are forked processes (one intra-op thread each) in one gloo process group; every variant is built once
through the trainer's own hooks (``moetrain.parallel.launch.start``), from the same per-index initialisation, on
the ``tiny`` preset's shapes with ``--layers`` blocks (the reference: the same weights, not sharded, its step the
trainer's ``train_step`` with a flat all-reduce as ``sync_grads``). The variants then alternate: each round times ``--steps``
optimizer steps of each variant (between barriers, order rotated every round), so slow phases of a shared machine
hit every variant alike. Printed: the median tokens/s of each variant over the rounds, their ratios to the
reference, the median CPU time per step of both ranks together (``time.process_time``: steadier than tokens/s on
a shared machine, since time the other jobs take is not counted; waiting for the other rank is not counted either),
the CPU model and the load average before and after.

Then one ZeRO-3 step is profiled (``torch.profiler``, CPU activities, both ranks) and rank 0's Chrome trace is
written to ``--trace`` (open it in ``chrome://tracing`` or Perfetto); from rank 0's events, the share of the
reduce-scatters' transfer time during which backward compute ran (:func:`overlap`). Nothing is asserted (speed
belongs here, not in tests).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REFERENCE = "flat_allreduce"  # not the engine: see _build_reference
VARIANTS: dict[str, dict] = {REFERENCE: {}, "plain_dp": {}, "fsdp_zero3": {"dp_shard": 2},
                             "fsdp_zero2": {"dp_shard": 2, "reshard_after_forward": False}}
WORLD = 2


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def _config(variant: str, layers: int, grad_accum: int = 1):
    from moetrain.config import build_config

    return build_config("tiny", overrides={
        "model": {"n_layers": layers}, "train": {"device": "cpu", "grad_accum": grad_accum},
        "parallel": {"timeout_s": 300, **VARIANTS[variant]}})


class _Reference:
    """The reference's step: the trainer's ``train_step`` on the whole, unsharded model, whose ``sync_grads`` all-
    reduces every gradient in one flat buffer after backward and then clips locally (the gradients are the same on
    both ranks); losses and expert counts are reduced as the engine does."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def build_model(self, config, device: torch.device, seed: int) -> torch.nn.Module:
        from moetrain.parallel.meta_init import build_meta, materialise

        return materialise(build_meta(config), config, device, seed)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        self.model = model
        return model

    def local_batch(self, next_batch):
        def mine() -> tuple[torch.Tensor, torch.Tensor]:
            inputs, targets = next_batch()
            rows = slice(self.rank * inputs.shape[0] // WORLD, (self.rank + 1) * inputs.shape[0] // WORLD)
            return inputs[rows], targets[rows]

        return mine

    def sync_grads(self, max_norm: float) -> torch.Tensor:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)  # one copy in, one all-reduce, one copy out
        dist.all_reduce(flat)
        flat /= WORLD
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    @staticmethod
    def sum(values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values)
        return values

    def train_step(self, model, next_batch, optimizer, scheduler, config, device: torch.device):
        from moetrain.train.step import train_step

        return train_step(model, next_batch, optimizer, scheduler, config, device, count_reducer=self.sum,
                          sync_grads=self.sync_grads, reduce_mean=lambda v: self.sum(v.clone()) / WORLD)


def _build(variant: str, layers: int, grad_accum: int = 1) -> dict:
    """The variant's hooks, model, optimizer, scheduler and this rank's batches, as the trainer builds them."""
    from moetrain.parallel.launch import start
    from moetrain.train.schedule import build_scheduler
    from moetrain.train.trainer import build_optimizer

    cfg = _config(variant, layers, grad_accum)
    hooks = _Reference(dist.get_rank()) if variant == REFERENCE else start(cfg, "cpu")
    model = hooks.prepare_model(hooks.build_model(cfg.model, torch.device("cpu"), cfg.train.seed))
    opt = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(0)
    b, s = cfg.train.batch_size, cfg.data.seq_len

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen)
        return x[:, :-1], x[:, 1:]

    return {"hooks": hooks, "model": model, "opt": opt, "sched": build_scheduler(opt, cfg.train), "cfg": cfg,
            "next": hooks.local_batch(batch), "tokens": b * s * cfg.train.grad_accum}


def _step(v: dict) -> None:
    v["hooks"].train_step(v["model"], v["next"], v["opt"], v["sched"], v["cfg"].train, torch.device("cpu"))


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    try:
        built = {name: _build(name, args.layers, args.grad_accum) for name in VARIANTS}
        for v in built.values():
            for _ in range(args.warmup):
                _step(v)
        rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu_ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    _step(built[name])
                used = torch.tensor(time.process_time() - c0, dtype=torch.float64)
                dist.barrier()
                rates[name].append(args.steps * built[name]["tokens"] / (time.perf_counter() - t0))
                dist.all_reduce(used)  # both ranks' CPU seconds
                cpu_ms[name].append(1e3 * float(used) / args.steps)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(built["fsdp_zero3"])
        if rank == 0:
            prof.export_chrome_trace(args.trace)
            Path(out).write_text(json.dumps({"rates": rates, "cpu_ms": cpu_ms}))
    finally:
        dist.destroy_process_group()


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions of intervals."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)


def _minus(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union ``xs`` without the union ``ys``."""
    out = []
    for a, b in xs:
        cur = a
        for c, d in ys:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def overlap(trace: Path) -> dict:
    """From a ``torch.profiler`` Chrome trace of one FSDP2 step (times in microseconds):

    - ``reduce_us``: the reduce-scatters' transfers: the gloo events of gloo's worker threads (``gloo:*``) that start
      inside an ``FSDP::post_backward_reduce`` event of the training thread, i.e. were issued by a reduce-scatter
      (``c10d::_reduce_scatter_base_``); the ``FSDP::post_backward_reduce`` events themselves when there are none
      (a backend without worker threads);
    - ``compute_us``: backward compute: autograd's ``evaluate_function`` events of the training thread minus the
      time inside FSDP2's post-backward hooks (``FSDP::post_backward_*``: copies, the reduce-scatter and its wait);
    - ``overlapped_us``: the transfer time during which backward compute ran.
    """
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]

    def iv(es: list[dict]) -> list[tuple[float, float]]:
        return _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in es])

    issues = [e for e in events if "reduce_scatter" in e["name"]]
    main = {e["tid"] for e in issues}
    windows = iv([e for e in events if e["name"].startswith("FSDP::post_backward_reduce") and e["tid"] in main])
    work = [e for e in events if e["name"].startswith("gloo:") and e["tid"] not in main
            and any(a <= e["ts"] <= b for a, b in windows)]
    reduce = iv(work) if work else windows
    hooks = iv([e for e in events if e["name"].startswith("FSDP::post_backward") and e["tid"] in main])
    backward = iv([e for e in events if e["name"].startswith("autograd::engine::evaluate_function")
                   and e["tid"] in main])
    compute = _minus(backward, hooks)
    return {"reduce_scatters": len(issues), "transfers": len(work), "reduce_us": _length(reduce),
            "wait_us": _length(windows), "backward_us": _length(backward), "compute_us": _length(compute),
            "overlapped_us": _intersection(reduce, compute)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4, help="blocks of the tiny-shaped model")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--trace", default="fsdp_step_trace.json", help="Chrome trace of one ZeRO-3 step (rank 0)")
    args = p.parse_args()
    load0 = os.getloadavg()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(args.trace).with_suffix(".rates.json")
    t0 = time.monotonic()
    mp.start_processes(_worker, args=(port, args, str(out)), nprocs=WORLD, join=True, start_method="fork")
    record = json.loads(out.read_text())
    rates, cpu_ms = record["rates"], record["cpu_ms"]
    out.unlink()
    load1 = os.getloadavg()
    print(f"{datetime.date.today()}, {_cpu_model()}, {os.cpu_count()} CPUs; load average {load0[0]:.1f} before, "
          f"{load1[0]:.1f} after; {time.monotonic() - t0:.0f} s")
    cfg = _config(REFERENCE, args.layers, args.grad_accum)
    print(f"tiny shapes with {args.layers} blocks (hidden {cfg.model.hidden}, {cfg.model.moe.num_experts} experts), "
          f"{cfg.train.grad_accum} x {cfg.train.batch_size} x {cfg.data.seq_len} tokens per step, {WORLD} gloo "
          f"ranks, {args.rounds} "
          f"alternating rounds of {args.steps} steps")
    base, cpu_base = statistics.median(rates[REFERENCE]), statistics.median(cpu_ms[REFERENCE])
    for name, values in rates.items():
        med, cpu = statistics.median(values), statistics.median(cpu_ms[name])
        print(f"  {name:14s} median {med:8.0f} tokens/s ({min(values):.0f}-{max(values):.0f}), "
              f"{med / base:.2f}x the reference; CPU {cpu:.1f} ms per step, both ranks "
              f"({min(cpu_ms[name]):.1f}-{max(cpu_ms[name]):.1f}), {cpu / cpu_base:.2f}x")
    o = overlap(Path(args.trace))
    share = o["overlapped_us"] / o["reduce_us"] if o["reduce_us"] else 0.0
    print(f"trace {args.trace} (rank 0, one ZeRO-3 step): {o['reduce_scatters']} reduce-scatters, their transfers "
          f"{o['reduce_us'] / 1e3:.1f} ms on gloo's threads ({o['transfers']} events); backward "
          f"{o['backward_us'] / 1e3:.1f} ms, of which compute {o['compute_us'] / 1e3:.1f} ms and FSDP2's "
          f"post-backward reduce (issue + wait) {o['wait_us'] / 1e3:.1f} ms; reduce-scatter time overlapped by "
          f"backward compute: {share:.0%}")

if __name__ == "__main__":
    main()
