"""``moetrain doctor [RUN_DIR]``: why is training slow here? The machine, a calibrated GEMM peak, a short profiled
window of the run's training steps split into forward, backward, optimizer and monitoring, its MFU, the run's own
logged figures against the window's, and one recommendation per finding (each figure and how it is checked:
docs/robustness.md, "moetrain doctor").
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from moetrain.commands import check_at_least


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="measure why training is slow here (peak, MFU, time shares, threads, bf16)")
    p.add_argument("run_dir", nargs="?", help="a run directory (default: profile the cpu-small preset)")
    p.add_argument("--steps", type=int, default=3, help="profiled training steps after one warm-up (default 3)")
    p.set_defaults(func=run)


def batch_shape(config) -> tuple[int, int]:
    """(rows, seq_len) of one micro-batch: ``train.batch_size`` x ``data.seq_len``; with a token budget
    (``train.tokens_per_batch``) the rows of full-length rows that fit it."""
    t, s = config.train, config.data.seq_len
    return (max(1, t.tokens_per_batch // s) if t.tokens_per_batch else t.batch_size), s


def profile_steps(config, steps: int) -> dict[str, float]:
    """Median seconds per training step of ``config``'s model over ``steps`` steps after one warm-up, on the CPU,
    on random tokens of :func:`batch_shape`, run by :func:`moetrain.train.step.train_step` with the run's routing
    monitor attached (docs/robustness.md).

    Returns:
        ``step``: train_step + monitoring; ``forward``: the model's forward calls (module hooks on the model);
        ``optimizer``: AdamW's step (its step hooks); ``monitoring``: ``end_step`` + flush / log_every;
        ``backward``: the rest of train_step (backward passes, gradient clipping, the rest of the bookkeeping).
    """
    import torch

    from moetrain.model.transformer import MoETransformer
    from moetrain.train.monitor import RoutingMonitor
    from moetrain.train.schedule import build_scheduler
    from moetrain.train.step import train_step
    from moetrain.train.trainer import build_optimizer

    t, device = config.train, torch.device("cpu")
    model = MoETransformer(config.model).train()
    opt = build_optimizer(model, config)
    sched = build_scheduler(opt, t)
    gen = torch.Generator().manual_seed(0)
    rows, seq = batch_shape(config)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, config.model.vocab_size, (rows, seq + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:]

    clock = {"forward": 0.0, "optimizer": 0.0}
    started: dict[str, float] = {}

    def timer(name: str):  # a pre-hook and a post-hook that add the seconds between them to clock[name]
        def begin(*_) -> None:
            started[name] = time.perf_counter()

        def end(*_) -> None:
            clock[name] += time.perf_counter() - started[name]
        return begin, end

    for name, pre, post in (("forward", model.register_forward_pre_hook, model.register_forward_hook),
                            ("optimizer", opt.register_step_pre_hook, opt.register_step_post_hook)):
        begin, end = timer(name)
        pre(begin)
        post(end)
    parts: dict[str, list[float]] = {"train_step": [], "forward": [], "optimizer": [], "end_step": []}
    with tempfile.TemporaryDirectory() as tmp:
        monitor = RoutingMonitor(model, config.monitor, Path(tmp), log=lambda _: None)
        try:
            for i in range(steps + 1):
                clock.update(forward=0.0, optimizer=0.0)
                t0 = time.perf_counter()
                result = train_step(model, next_batch, opt, sched, t, device)
                t1 = time.perf_counter()
                monitor.end_step(i + 1, result.lm_loss)
                float(result.lm_loss)  # the trainer reads the loss every step (a host sync)
                t2 = time.perf_counter()
                if i > 0:  # the first step warms up the allocator, thread pool and kernels
                    for k, v in (("train_step", t1 - t0), ("forward", clock["forward"]),
                                 ("optimizer", clock["optimizer"]), ("end_step", t2 - t1)):
                        parts[k].append(v)
            t0 = time.perf_counter()
            monitor.flush(steps + 1, None)
            flush = time.perf_counter() - t0
        finally:
            monitor.close()
    med = {k: statistics.median(v) for k, v in parts.items()}
    monitoring = med["end_step"] + flush / max(1, t.log_every)
    return {"step": med["train_step"] + monitoring, "forward": med["forward"], "optimizer": med["optimizer"],
            "backward": max(0.0, med["train_step"] - med["forward"] - med["optimizer"]), "monitoring": monitoring}


def step_flops(config) -> float:
    """Model FLOPs of one optimizer step of :func:`batch_shape` micro-batches (forward + backward, no recomputation;
    ``moetrain.analysis``)."""
    from moetrain.analysis.flops import model_flops_per_token
    from moetrain.analysis.shape import ModelShape

    rows, seq = batch_shape(config)
    return model_flops_per_token(ModelShape.from_config(config.model), seq) * rows * seq * config.train.grad_accum


def run_processes(run_dir: str | None) -> int | None:
    """How many processes the run trained in: 1 for a single-format checkpoint (``model.safetensors``), the ranks of
    a sharded one (``__<rank>_0.distcp`` files, a torchrun job); ``None`` without a run or a checkpoint."""
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("step_*")) if run_dir is not None else []
    if not ckpts:
        return None
    shards = {p.name.split("_")[2] for p in ckpts[-1].glob("__*_*.distcp")}
    if shards:
        return len(shards)
    return 1 if (ckpts[-1] / "model.safetensors").is_file() else None


def _run_metrics(run_dir: str | None, flops_per_token: float) -> dict[str, float] | None:
    """From the run's own logging steps (``None`` without them): median ``tokens_per_s`` and ``mfu``; ``peak``, the
    GEMM peak its MFU was computed against (``flops_per_token`` x tokens/s / mfu); ``data_share`` and
    ``monitor_share``, the seconds logged as ``data_wait_s`` / ``monitor_s`` over the wall time of those steps
    (:func:`_wall`)."""
    if run_dir is None or not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    from moetrain.report.runlog import load_run_log

    records = [r for r in load_run_log(run_dir).records if r.get("tokens_per_s")]
    if not records:
        return None
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records)}
    mfus = [r for r in records if r.get("mfu")]
    if mfus:
        out["mfu"] = statistics.median(r["mfu"] for r in mfus)
        out["peak"] = statistics.median(flops_per_token * r["tokens_per_s"] / r["mfu"] for r in mfus)
    wall = _wall(run_dir, records)
    for key, share in (("data_wait_s", "data_share"), ("monitor_s", "monitor_share")):
        values = [r[key] for r in records if r.get(key) is not None]
        if values and wall:
            out[share] = sum(values) / wall
    return out


def _wall(run_dir: str, records: list[dict]) -> float:
    """Seconds covered by the logging ``records`` (each covers the steps since the previous one): the increments
    of their ``elapsed_s`` (the loop's clock; a resumed process starts it again at 0); for runs that predate
    ``elapsed_s``, each record's steps x tokens per step / its tokens_per_s."""
    if all(r.get("elapsed_s") is not None for r in records):
        wall, prev = 0.0, 0.0
        for r in records:
            wall += r["elapsed_s"] - prev if r["elapsed_s"] >= prev else r["elapsed_s"]
            prev = r["elapsed_s"]
        return wall
    c = json.loads((Path(run_dir) / "config.json").read_text())
    per_step = c["train"]["batch_size"] * c["train"].get("grad_accum", 1) * c["data"]["seq_len"]
    wall, step = 0.0, 0
    for r in records:
        wall += (r["step"] - step) * per_step / r["tokens_per_s"]
        step = r["step"]
    return wall


def compare_with_run(d: dict) -> str | None:
    """Why the run's logged MFU differs from the profiled window's (``None`` without the run's MFU), as the product
    of two measured ratios (docs/robustness.md, "Why the run's MFU and doctor's differ")."""
    run = d["run"] or {}
    if "mfu" not in run:
        return None
    speed = run["tokens_per_s"] / (d["tokens_per_step"] / d["times"]["step"])
    peak = d["peak_flops"][d["compute_dtype"]]
    measured = [f"{name} {100 * run[k]:.1f}%" for k, name in (("data_share", "data loading"),
                                                               ("monitor_share", "monitoring")) if k in run]
    warning = ""
    if run["mfu"] > 1:  # runs from before the trainer measured its peak again above 100% (console.Console.mfu)
        warning = (f"; a logged MFU above 100% means the run's peak was calibrated while the machine was busier "
                   f"than during its steps (its {run['peak'] / 1e9:.1f} GFLOP/s is too low): trust this window's "
                   f"MFU instead")
    return (f"the run's MFU {100 * run['mfu']:.1f}% vs this window's {100 * d['mfu']:.1f}%: its tokens/s were "
            f"{speed:.2f}x the window's (its wall time also holds {', '.join(measured + [''])}evaluations, "
            f"checkpoints and the first step's warm-up) and its peak, calibrated at its start, "
            f"{run['peak'] / 1e9:.1f} GFLOP/s against {peak / 1e9:.1f} here: {speed:.2f} x {peak / 1e9:.1f} / "
            f"{run['peak'] / 1e9:.1f} = {speed * peak / run['peak']:.2f} of this window's MFU{warning}")


def diagnose(config, run_dir: str | None, steps: int) -> dict:
    """Everything :func:`run` prints, as a dict (for tests and scripts): the GEMM peaks, the best of interleaved
    rounds before and after the profiled window (:func:`moetrain.analysis.hardware.measure_peaks`); ``unreliable``,
    why the figures cannot be trusted, or ``None``; the MFU, the achieved rate over ``max(peak, achieved)``; and
    ``mfu_measured``, False where the steps ran faster than every peak round (load held the peak down)."""
    from moetrain.analysis.hardware import UNRELIABLE_BUSY_CORES, measure_peaks
    from moetrain.runtime.cpu import cpu_info
    from moetrain.runtime.threads import choose_threads

    threads = choose_threads(config.train.threads)
    cpu = cpu_info()
    compute = "bf16" if config.train.dtype == "bf16" and cpu["bf16_fast"] else "fp32"
    peaks = measure_peaks(rounds=2)
    times = profile_steps(config, steps)
    peaks = peaks.merged(measure_peaks(rounds=2))  # the load may change while the window runs
    peak = {d: peaks.best(d) for d in ("fp32", "bf16")}
    unreliable = peaks.unreliable()
    if unreliable is None and threads.busy is not None and threads.busy >= UNRELIABLE_BUSY_CORES:
        unreliable = f"other processes kept {threads.busy:.1f} cores busy"
    flops = step_flops(config)
    rows, seq = batch_shape(config)
    tokens = rows * seq * config.train.grad_accum
    achieved = flops / times["step"]
    return {**cpu, "threads": threads.threads, "usable_cores": threads.usable_cores, "load": threads.load,
            "busy": threads.busy, "threads_requested": threads.requested, "peak_flops": peak,
            "peak_rounds": peaks.rates, "bf16_ratios": peaks.ratios("bf16", "fp32"), "unreliable": unreliable,
            "compute_dtype": compute, "dtype": config.train.dtype, "step_flops": flops, "tokens_per_step": tokens,
            "times": times, "achieved_flops": achieved, "mfu": achieved / max(peak[compute], achieved),
            "mfu_measured": achieved <= peak[compute], "processes": run_processes(run_dir),
            "run": _run_metrics(run_dir, flops / tokens)}


def findings(d: dict) -> list[str]:
    """One recommendation per finding, most costly first."""
    from moetrain.runtime.threads import default_threads

    out = []
    busy = d.get("busy")  # cores other processes keep busy; the load average where that was not measured
    load, what = (busy, "other processes busy on") if busy is not None else (d["load"] or 0.0, "a load of")
    fit = default_threads(d["usable_cores"], load)  # the rule the trainer's own choice follows
    if d["threads"] > fit:
        out.append(f"threads: {d['threads']} threads on {d['usable_cores']} usable cores with {what} {load:.1f} "
                   f"oversubscribe the CPU; set train.threads={fit}")
    if d["dtype"] == "bf16" and not d["bf16_fast"]:
        out.append("bf16: this CPU has no fast bf16 GEMMs, so train.dtype=bf16 computes in fp32 here; use "
                   "train.dtype=fp32 (same speed, full precision)")
    elif d["dtype"] == "fp32" and d["bf16_fast"] and d["peak_flops"]["bf16"] > 1.5 * d["peak_flops"]["fp32"]:
        ratio = d["peak_flops"]["bf16"] / d["peak_flops"]["fp32"]
        ratios = d.get("bf16_ratios") or [ratio]
        if d.get("unreliable"):
            out.append(f"bf16: bf16 GEMMs ran {min(ratios):.1f}x-{max(ratios):.1f}x the fp32 rate here, a range too "
                       f"wide to trust ({d['unreliable']}); train.dtype=bf16 may be faster: measure again when the "
                       "machine is idle")
        else:
            out.append(f"bf16: bf16 GEMMs run {ratio:.1f}x the fp32 rate here; train.dtype=bf16 may be faster")
    t = d["times"]
    if t["optimizer"] > 0.25 * t["step"]:
        out.append(f"optimizer: {100 * t['optimizer'] / t['step']:.0f}% of the step; a larger train.batch_size (or "
                   "train.grad_accum) spreads its cost over more tokens")
    run = d["run"] or {}
    if run.get("data_share", 0) > 0.1:
        out.append(f"data: the run waited for data {100 * run['data_share']:.0f}% of the time; prepare the corpus "
                   "once (data.cache_dir) or use a smaller data.seq_len window")
    monitoring = max(run.get("monitor_share", 0.0), t.get("monitoring", 0.0) / t["step"])
    if monitoring > 0.1:
        out.append(f"monitoring: the routing monitor takes {100 * monitoring:.0f}% of the time; log less often "
                   "(a larger train.log_every) or turn off monitor.tb_histograms / monitor.tb_heatmap")
    if d.get("mfu_measured", True) and d["mfu"] < 0.2 and not out:
        out.append(f"MFU {100 * d['mfu']:.0f}%: small GEMMs (model.hidden, expert FFN, tokens per expert) run far "
                   "below the peak; a larger train.batch_size raises the tokens per expert")
    return out or ["nothing to fix: the steps run near what this machine's GEMMs allow"]


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def _communication(processes: int | None) -> str:
    if processes == 1:
        return "communication 0% (the run was one process)"
    if processes:
        return (f"communication not measured (the run used {processes} processes, this window one; its per-rank "
                "exchange is in metrics.jsonl, ep/rank*/a2a_bytes_sent)")
    return "communication none in this one-process window (a torchrun job's is not measured here)"


def run(args) -> int:
    from moetrain.commands.run_dir import read_run_config
    from moetrain.config import Config, build_config

    check_at_least(args, 1, "steps")
    config = build_config() if args.run_dir is None else Config.from_dict(read_run_config(args.run_dir))
    d = diagnose(config, args.run_dir, args.steps)
    load = "unknown" if d["load"] is None else f"{d['load']:.1f}"
    busy = "" if d.get("busy") is None else f", {d['busy']:.1f} of them busy with other processes"
    print(f"machine: {d['cpu_model']}; {d['usable_cores']} usable cores{busy}, load average {load}, {d['threads']} "
          f"intra-op threads")
    flags = ", ".join(d["bf16_flags"]) or "none"
    print(f"bf16: native flags {flags}; {'fast' if d['bf16_fast'] else 'slow'} ({d['bf16_reason']})")
    rounds = len(d["peak_rounds"]["fp32"])
    print(f"peak (calibrated 1024^3 GEMM, best of {rounds} rounds around the profiled steps): fp32 "
          f"{d['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s, bf16 {d['peak_flops']['bf16'] / 1e9:.1f} GFLOP/s")
    if d["unreliable"]:
        print(f"note: the figures below are unreliable: {d['unreliable']} (the machine is under load); run "
              "moetrain doctor again when it is idle")
    t = d["times"]
    what = args.run_dir or f"preset {config.preset}"
    print(f"profiled {args.steps} steps of {what} (train.dtype={d['dtype']}, computing in {d['compute_dtype']}): "
          f"step {t['step'] * 1e3:.1f} ms = forward {_pct(t['forward'], t['step'])}, backward "
          f"{_pct(t['backward'], t['step'])}, optimizer {_pct(t['optimizer'], t['step'])}, monitoring "
          f"{_pct(t['monitoring'], t['step'])}; {_communication(d['processes'])}")
    if d["mfu_measured"]:
        mfu = f"MFU {100 * d['mfu']:.1f}% of the {d['compute_dtype']} peak"
    else:
        mfu = (f"MFU not measured: the steps ran faster than every {d['compute_dtype']} peak round "
               f"({d['peak_flops'][d['compute_dtype']] / 1e9:.2f} GFLOP/s at best), so load held the peak down; run "
               "moetrain doctor again when the machine is idle")
    print(f"model FLOPs per step {d['step_flops'] / 1e9:.2f} GFLOP (moetrain.analysis); achieved "
          f"{d['achieved_flops'] / 1e9:.2f} GFLOP/s; {mfu}")
    run_m = d["run"]
    if run_m:
        shares = [f", {name} {100 * run_m[k]:.1f}%{tail}" for k, name, tail in (
            ("mfu", "MFU", ""), ("data_share", "data loading", " of the time"), ("monitor_share", "monitoring", ""))
            if k in run_m]
        print(f"the run's own log: median {run_m['tokens_per_s']:.0f} tokens/s{''.join(shares)}")
        why = compare_with_run(d)
        if why:
            print(why)
    for f in findings(d):
        print(f"- {f}")
    return 0
