"""How much routing-health monitoring adds to a training step (the ``tiny`` preset by default).

Runs the real optimizer step (``moetrain.train.step.train_step``) in alternating blocks with and without a
``RoutingMonitor`` (forward hooks on every MoE layer, ``end_step`` every step, ``flush`` with TensorBoard
histograms and heatmaps every ``train.log_every`` steps, as in the trainer), and prints:

- the median step time of each mode and the relative difference (alternating blocks cancel slow drifts of a shared
  machine, but the difference is still noisy when the machine is busy; ``--clock cpu``, the default, counts the
  process's CPU time, which a busy machine inflates far less than elapsed time);
- the time spent inside the monitor's own calls (hooks, ``end_step``, ``flush``), measured directly around them,
  as a share of the step: on the CPU this is the monitor's whole cost; on a GPU it is its host (launch) cost.

Usage: ``python benchmarks/monitor_overhead.py [--preset tiny] [--device cpu|cuda] [--blocks 16] [--block-steps 10]``.
Prints figures only; nothing is asserted (speed belongs here, not in tests).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moetrain.config import build_config
from moetrain.data.dataset import BatchSampler, TokenWindows, prepare_data
from moetrain.model.transformer import MoETransformer
from moetrain.train.metrics import MetricsLogger
from moetrain.train.monitor import RoutingMonitor
from moetrain.train.routing_stats import RoutingStats
from moetrain.train.schedule import build_scheduler
from moetrain.train.step import train_step
from moetrain.train.trainer import build_optimizer

BASE_KEYS = ("step", "train_loss", "lr", "grad_norm")
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def corpus(tmp: Path) -> Path:
    if SHAKESPEARE.is_file():
        return SHAKESPEARE
    rng = random.Random(0)
    words = "the king lord thou art my good sweet love night day speak hath noble heart shall come away".split()
    path = tmp / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(30000)))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per mode (alternating)")
    ap.add_argument("--block-steps", type=int, default=10, help="optimizer steps per block")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: the default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: process CPU time (robust on a shared machine; all threads of this process, so it "
                         "includes the TensorBoard writer thread); wall: elapsed time (use on an idle machine or "
                         "a GPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        total_steps = 2 * args.blocks * args.block_steps + 10
        cfg = build_config(args.preset, overrides={
            "data": {"path": str(corpus(tmp)), "cache_dir": str(tmp / "cache")},
            "train": {"steps": total_steps, "device": args.device}})
        t = cfg.train
        torch.manual_seed(0)
        data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda m: None)
        sampler = BatchSampler(TokenWindows(data.train_tokens, cfg.data.seq_len), t.batch_size, t.seed)
        model = MoETransformer(cfg.model).to(device)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, t)
        model.train()

        metrics = MetricsLogger(tmp)  # metrics.jsonl + TensorBoard scalars, as in the trainer
        writer = metrics.writer
        # Seconds in monitor calls ("on" blocks); "metrics" is the share of MetricsLogger.log spent on the monitor's
        # fields (prorated by key count: the TensorBoard scalar events it mirrors).
        inside = dict.fromkeys(("hooks", "end_step", "flush", "metrics"), 0.0)

        # The monitor's own calls are timed on this thread's CPU clock (with --clock cpu): the process clock would
        # also count whatever the TensorBoard writer thread does meanwhile, for both modes.
        inner_clock = time.thread_time if args.clock == "cpu" else time.perf_counter

        def timed(fn, key):
            def wrapper(*a, **k):
                t0 = inner_clock()
                try:
                    return fn(*a, **k)
                finally:
                    inside[key] += inner_clock() - t0
            return wrapper

        original_observe = RoutingStats.observe
        RoutingStats.observe = timed(original_observe, "hooks")  # the hooks' work
        step = 0
        times: dict[str, list[float]] = {"off": [], "on": []}
        pairs: list[float] = []  # per adjacent (off, on) block pair: on mean / off mean - 1

        the_monitor = RoutingMonitor(model, cfg.monitor, tmp, log=lambda m: None)
        the_monitor.detach()

        def run_block(monitored: bool) -> None:
            nonlocal step
            monitor = the_monitor if monitored else None
            if monitor is not None:
                monitor.attach()
            for _ in range(args.block_steps):
                t0 = clock()
                result = train_step(model, sampler.next_batch, optimizer, scheduler, t, device)
                step += 1
                if monitor is not None:
                    timed(monitor.end_step, "end_step")(step, result.lm_loss)
                loss = float(result.lm_loss)  # the trainer's own per-step sync, in both modes
                if step % t.log_every == 0:
                    record = {"step": step, "train_loss": loss, "lr": result.lr, "grad_norm": float(result.grad_norm)}
                    if monitor is not None:
                        record.update(timed(monitor.flush, "flush")(step, writer))
                    t_log = inner_clock()
                    metrics.log(record)
                    if monitor is not None:  # the TensorBoard scalars of the monitor's fields
                        inside["metrics"] += (inner_clock() - t_log) * (1 - len(BASE_KEYS) / len(record))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times["on" if monitored else "off"].append(clock() - t0)
            if monitor is not None:
                monitor.detach()

        run_block(False)  # warm-up (allocator, kernels, TensorBoard writer)
        run_block(True)
        times = {"off": [], "on": []}
        inside.update(dict.fromkeys(inside, 0.0))
        for pair in range(args.blocks):  # off-on, on-off, off-on, ... (ABBA cancels linear drifts)
            for monitored in ((False, True) if pair % 2 == 0 else (True, False)):
                run_block(monitored)
            last = slice(-args.block_steps, None)
            pairs.append(statistics.fmean(times["on"][last]) / statistics.fmean(times["off"][last]) - 1)
        the_monitor.close()
        metrics.close()
        RoutingStats.observe = original_observe

    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    mean_off, mean_on = statistics.fmean(times["off"]), statistics.fmean(times["on"])
    n_on = len(times["on"])
    print(f"preset {args.preset} on {device} ({torch.get_num_threads()} CPU threads), "
          f"{len(times['off'])} + {n_on} timed steps, log_every={cfg.train.log_every}, {args.clock} clock")
    # The mean includes the logging steps (1 in log_every), where flush does most of its work; the median does not.
    print(f"  mean step time   without / with monitor  {1e3 * mean_off:8.2f} / {1e3 * mean_on:8.2f} ms   "
          f"({100 * (mean_on - mean_off) / mean_off:+.2f} %)")
    print(f"  median step time without / with monitor  {1e3 * off:8.2f} / {1e3 * on:8.2f} ms   "
          f"({100 * (on - off) / off:+.2f} %)")
    q = statistics.quantiles(pairs, n=4) if len(pairs) >= 2 else [pairs[0]] * 3
    print(f"  paired blocks: median overhead {100 * q[1]:+.2f} %  (quartiles {100 * q[0]:+.2f} % .. "
          f"{100 * q[2]:+.2f} %, {len(pairs)} pairs of {args.block_steps} steps)")
    total = sum(inside.values())
    print(f"  inside monitor calls per step     {1e3 * total / n_on:8.3f} ms   "
          f"({100 * total / n_on / mean_on:.2f} % of a monitored step)")
    for key, seconds in inside.items():
        print(f"    {key:<10} {1e3 * seconds / n_on:8.3f} ms/step ({100 * seconds / n_on / mean_on:.2f} %)")


if __name__ == "__main__":
    main()
