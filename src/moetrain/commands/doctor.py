"""``moetrain doctor [RUN_DIR]``: why is training slow here? Measured, with one recommendation per finding.

It reports
- the machine: CPU model, usable cores, load average, the intra-op threads a run would choose, native bf16 flags;
- the hardware peak: calibrated GEMM rate (1024^3 products) in fp32 and bf16 with those threads;
- a short profiled window of training steps of the run's model (RUN_DIR's ``config.json``; default: the default
  job's ``cpu-small`` preset) on random tokens of the run's batch shape: the median step time split into forward,
  backward and optimizer, and the achieved model FLOP/s and MFU (``moetrain.analysis`` FLOPs of one step / the
  median step time / the calibrated peak in the run's compute dtype);
- from the run's own ``metrics.jsonl`` (when given a run): its logged tokens/s, MFU and the share of time it waited
  for data (``data_wait_s``);
- communication: none in one process (the all-to-all and all-reduce appear under torchrun only).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="measure why training is slow here (peak, MFU, time shares, threads, bf16)")
    p.add_argument("run_dir", nargs="?", help="a run directory (default: profile the cpu-small preset)")
    p.add_argument("--steps", type=int, default=3, help="profiled training steps after one warm-up (default 3)")
    p.set_defaults(func=run)


def _config(run_dir: str | None):
    from moetrain.config import Config, build_config

    if run_dir is None:
        return build_config(None, None, {})
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise MoetrainError(f"{path} not found; is '{run_dir}' a moetrain run directory?")
    try:
        return Config.from_dict(json.loads(path.read_text()))
    except ValueError as e:
        if isinstance(e, MoetrainError):
            raise
        raise MoetrainError(f"{path}: cannot parse: {e}") from None


def profile_steps(config, steps: int) -> dict[str, float]:
    """Median seconds of ``forward``, ``backward``, ``optimizer`` and ``step`` (their sum) over ``steps`` training
    steps (after one warm-up) of ``config``'s model on random tokens of its batch shape, on the CPU, with the
    run's dtype policy (:func:`moetrain.train.step.autocast_context`)."""
    import torch

    from moetrain.model.transformer import MoETransformer
    from moetrain.train.step import autocast_context
    from moetrain.train.trainer import build_optimizer

    t, device = config.train, torch.device("cpu")
    model = MoETransformer(config.model).train()
    opt = build_optimizer(model, config)
    gen = torch.Generator().manual_seed(0)
    shape = (t.batch_size, config.data.seq_len)
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for i in range(steps + 1):
        f = b = 0.0
        for _ in range(t.grad_accum):
            ids = torch.randint(0, config.model.vocab_size, (shape[0], shape[1] + 1), generator=gen)
            t0 = time.perf_counter()
            with autocast_context(device, t.dtype):
                out = model(ids[:, :-1], ids[:, 1:], return_logits=False)
            t1 = time.perf_counter()
            (out.loss / t.grad_accum).backward()
            f, b = f + t1 - t0, b + time.perf_counter() - t1
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        o = time.perf_counter() - t0
        if i > 0:  # the first step warms up the allocator, thread pool and kernels
            for k, v in (("forward", f), ("backward", b), ("optimizer", o)):
                parts[k].append(v)
    med = {k: statistics.median(v) for k, v in parts.items()}
    steps_total = [f + b + o for f, b, o in zip(*parts.values())]
    med["step"] = statistics.median(steps_total)
    return med


def step_flops(config) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recomputation; ``moetrain.analysis``)."""
    from moetrain.analysis.flops import model_flops_per_token
    from moetrain.analysis.shape import ModelShape

    t = config.train
    tokens = t.batch_size * t.grad_accum * config.data.seq_len
    return model_flops_per_token(ModelShape.from_config(config.model), config.data.seq_len) * tokens


def _run_metrics(run_dir: str | None) -> dict[str, float] | None:
    """Tokens/s, MFU and the data-wait share of the run's own logging steps (``None`` without them)."""
    if run_dir is None or not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    from moetrain.report.runlog import load_run_log

    records = [r for r in load_run_log(run_dir).records if r.get("tokens_per_s")]
    if not records:
        return None
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records)}
    mfus = [r["mfu"] for r in records if r.get("mfu") is not None]
    if mfus:
        out["mfu"] = statistics.median(mfus)
    waits = [r["data_wait_s"] for r in records if r.get("data_wait_s") is not None]
    if waits:
        # each record covers the steps since the previous one: wall time = tokens in them / tokens_per_s
        prev, wall = 0, 0.0
        for r in records:
            if r.get("data_wait_s") is not None:
                wall += (r["step"] - prev) * _tokens_per_step(run_dir) / r["tokens_per_s"]
            prev = r["step"]
        out["data_share"] = sum(waits) / wall if wall else 0.0
    return out


def _tokens_per_step(run_dir: str) -> int:
    c = json.loads((Path(run_dir) / "config.json").read_text())
    return c["train"]["batch_size"] * c["train"].get("grad_accum", 1) * c["data"]["seq_len"]


def diagnose(config, run_dir: str | None, steps: int) -> dict:
    """Everything :func:`run` prints, as a dict (for tests and scripts)."""
    import torch

    from moetrain.runtime.cpu import bf16_flags, bf16_support, cpu_model, gemm_peak
    from moetrain.runtime.threads import choose_threads

    threads = choose_threads(config.train.threads)
    peak = {"fp32": gemm_peak(torch.float32, "cpu"), "bf16": gemm_peak(torch.bfloat16, "cpu")}
    bf16 = bf16_support("cpu")
    compute = "bf16" if config.train.dtype == "bf16" and bf16.fast else "fp32"
    times = profile_steps(config, steps)
    flops = step_flops(config)
    achieved = flops / times["step"]
    return {"cpu": cpu_model(), "bf16_flags": bf16_flags(), "bf16_fast": bf16.fast, "bf16_reason": bf16.reason,
            "threads": threads.threads, "usable_cores": threads.usable_cores, "load": threads.load,
            "threads_requested": threads.requested, "peak_flops": peak, "compute_dtype": compute,
            "dtype": config.train.dtype, "step_flops": flops, "times": times, "achieved_flops": achieved,
            "mfu": achieved / peak[compute], "run": _run_metrics(run_dir)}


def findings(d: dict) -> list[str]:
    """One recommendation per finding, most costly first."""
    out = []
    load = d["load"] or 0.0
    fit = max(1, d["usable_cores"] - round(load))
    if d["threads"] > fit:
        out.append(f"threads: {d['threads']} threads on {d['usable_cores']} usable cores with a load of {load:.1f} "
                   f"oversubscribe the CPU; set train.threads={fit}")
    if d["dtype"] == "bf16" and not d["bf16_fast"]:
        out.append("bf16: this CPU has no fast bf16 GEMMs, so train.dtype=bf16 computes in fp32 here; use "
                   "train.dtype=fp32 (same speed, full precision)")
    elif d["dtype"] == "fp32" and d["bf16_fast"] and d["peak_flops"]["bf16"] > 1.5 * d["peak_flops"]["fp32"]:
        ratio = d["peak_flops"]["bf16"] / d["peak_flops"]["fp32"]
        out.append(f"bf16: bf16 GEMMs run {ratio:.1f}x the fp32 rate here; train.dtype=bf16 may be faster")
    t = d["times"]
    if t["optimizer"] > 0.25 * t["step"]:
        out.append(f"optimizer: {100 * t['optimizer'] / t['step']:.0f}% of the step; a larger train.batch_size (or "
                   "train.grad_accum) spreads its cost over more tokens")
    run = d["run"] or {}
    if run.get("data_share", 0) > 0.1:
        out.append(f"data: the run waited for data {100 * run['data_share']:.0f}% of the time; prepare the corpus "
                   "once (data.cache_dir) or use a smaller data.seq_len window")
    if d["mfu"] < 0.2 and not out:
        out.append(f"MFU {100 * d['mfu']:.0f}%: small GEMMs (model.hidden, expert FFN, tokens per expert) run far "
                   "below the peak; a larger train.batch_size raises the tokens per expert")
    return out or ["nothing to fix: the steps run near what this machine's GEMMs allow"]


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def run(args) -> int:
    if args.steps < 1:
        raise MoetrainError(f"--steps: must be >= 1, got {args.steps}")
    config = _config(args.run_dir)
    d = diagnose(config, args.run_dir, args.steps)
    load = "unknown" if d["load"] is None else f"{d['load']:.1f}"
    print(f"machine: {d['cpu']}; {d['usable_cores']} usable cores, load average {load}, {d['threads']} intra-op "
          f"threads")
    flags = ", ".join(d["bf16_flags"]) or "none"
    print(f"bf16: native flags {flags}; {'fast' if d['bf16_fast'] else 'slow'} ({d['bf16_reason']})")
    print(f"peak (calibrated 1024^3 GEMM): fp32 {d['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s, bf16 "
          f"{d['peak_flops']['bf16'] / 1e9:.1f} GFLOP/s")
    t = d["times"]
    what = args.run_dir or f"preset {config.preset}"
    print(f"profiled {args.steps} steps of {what} (train.dtype={d['dtype']}, computing in {d['compute_dtype']}): "
          f"step {t['step'] * 1e3:.1f} ms = forward {_pct(t['forward'], t['step'])}, backward "
          f"{_pct(t['backward'], t['step'])}, optimizer {_pct(t['optimizer'], t['step'])}; communication 0% (one "
          "process)")
    print(f"model FLOPs per step {d['step_flops'] / 1e9:.2f} GFLOP (moetrain.analysis); achieved "
          f"{d['achieved_flops'] / 1e9:.2f} GFLOP/s; MFU {100 * d['mfu']:.1f}% of the {d['compute_dtype']} peak")
    run_m = d["run"]
    if run_m:
        line = f"the run's own log: median {run_m['tokens_per_s']:.0f} tokens/s"
        if "mfu" in run_m:
            line += f", MFU {100 * run_m['mfu']:.1f}%"
        if "data_share" in run_m:
            line += f", data loading {100 * run_m['data_share']:.1f}% of the time"
        print(line + "; monitoring and checkpoints are in the time between logging steps")
    for f in findings(d):
        print(f"- {f}")
    return 0
