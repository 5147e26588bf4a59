"""Training speed of plain data parallelism and FSDP2 ZeRO-3 under ``torchrun`` (2 processes, gloo), this
checkout against other checkouts of moetrain (an older commit, another branch), interleaved in one run.

``python benchmarks/dp_before_after.py --version before=/path/to/old/src [--version main=/other/src] [--rounds 8]
[--steps 6] [--record]``

Each round launches ``torchrun --standalone --nproc_per_node 2`` once per version (the order rotated every round),
with ``PYTHONPATH`` at that version's ``src``; the job (this file's ``--worker`` mode, which uses only the hooks
every version has: ``moetrain.parallel.launch.start``, ``build_model``, ``prepare_model``, ``local_batch``,
``train_step``) builds each variant as the trainer does and times ``--steps`` optimizer steps of each (after
``--warmup``), between barriers:

- ``plain_dp``: 2 replicas (the default ``parallel`` section), ``train.grad_accum`` 1 and 4;
- ``zero3``: ``parallel.dp_shard=2`` (FSDP2, parameters resharded after forward).

``tiny`` preset shapes with ``--layers`` blocks, fp32, random tokens, one intra-op thread per rank. Printed per
variant: the median over the rounds of the ratio of each version's tokens/s to the first version's in the same
round (and the ratios' range, the rounds' spread), the median tokens/s, and the median CPU time per step of both
ranks (``time.process_time``, all threads: steadier than tokens/s on a shared machine); the first three losses of
each version (equal when the versions initialise the model alike). ``--record`` writes the figures as a record in
``results/`` (:func:`moetrain.results.write_record`). Nothing is asserted: speed belongs here, not in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
THIS_SRC = HERE.parent.parent / "src"
# name -> (parallel overrides, train.grad_accum)
VARIANTS: dict[str, tuple[dict, int]] = {"plain_dp": ({}, 1), "plain_dp_accum4": ({}, 4),
                                         "zero3": ({"dp_shard": 2}, 1)}


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from moetrain.config import build_config
    from moetrain.parallel.launch import start
    from moetrain.train.schedule import build_scheduler
    from moetrain.train.trainer import build_optimizer

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    cpu = torch.device("cpu")
    built = {}
    for name, (parallel, accum) in VARIANTS.items():
        cfg = build_config("tiny", overrides={
            "model": {"n_layers": args.layers}, "train": {"device": "cpu", "grad_accum": accum},
            "parallel": {"timeout_s": 300, **parallel}})
        hooks = start(cfg, "cpu")
        model = hooks.prepare_model(hooks.build_model(cfg.model, cpu, cfg.train.seed))
        opt = build_optimizer(model, cfg)
        gen = torch.Generator().manual_seed(0)
        b, s = cfg.train.batch_size, cfg.data.seq_len

        def batch(gen: torch.Generator = gen, b: int = b, s: int = s, vocab: int = cfg.model.vocab_size):
            x = torch.randint(0, vocab, (b, s + 1), generator=gen)
            return x[:, :-1], x[:, 1:]

        built[name] = (hooks, model, opt, build_scheduler(opt, cfg.train), cfg, hooks.local_batch(batch),
                       b * s * accum)

    def step(name: str):
        hooks, model, opt, sched, cfg, next_batch, _ = built[name]
        return hooks.train_step(model, next_batch, opt, sched, cfg.train, cpu)

    out: dict[str, dict] = {name: {"losses": [float(step(name).lm_loss) for _ in range(args.warmup)]}
                            for name in built}
    for name in built:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step(name)
        used = torch.tensor(time.process_time() - c0, dtype=torch.float64)
        dist.barrier()
        out[name]["tokens_per_s"] = args.steps * built[name][6] / (time.perf_counter() - t0)
        dist.all_reduce(used)  # both ranks' CPU seconds
        out[name]["cpu_ms_per_step"] = 1e3 * float(used) / args.steps
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _run(src: str, args: argparse.Namespace, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(HERE),
           "--worker", "--out", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--layers", str(args.layers)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{src}: the torchrun job failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def _cpu_model() -> str:
    sys.path.insert(0, str(THIS_SRC))
    from moetrain.runtime.cpu import cpu_model

    return cpu_model()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", action="append", default=[], metavar="NAME=SRC",
                   help="another checkout's src folder; the first one given is the baseline of the ratios")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per variant per job")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (their losses printed)")
    p.add_argument("--layers", type=int, default=4, help="blocks of the tiny-shaped model")
    p.add_argument("--record", action="store_true", help="write the figures as a record in results/")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    versions = dict(v.split("=", 1) for v in args.version)
    versions["this"] = str(THIS_SRC)
    names = list(versions)
    base = names[0]
    load0, t0 = os.getloadavg(), time.monotonic()
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                runs[n].append(_run(versions[n], args, Path(tmp) / f"{n}-{r}.json"))
            print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    load1 = os.getloadavg()
    cpu = _cpu_model()
    print(f"{cpu}, {os.cpu_count()} CPUs; load average {load0[0]:.1f} before, {load1[0]:.1f} after; "
          f"{time.monotonic() - t0:.0f} s; {args.rounds} rounds, {args.steps} timed steps per variant per job")
    figures: dict[str, float | int | str] = {"rounds": args.rounds, "steps": args.steps, "layers": args.layers,
                                             "load_average_before": round(load0[0], 1),
                                             "load_average_after": round(load1[0], 1)}
    rows = []
    for variant in VARIANTS:
        for n in names:
            rate = [run[variant]["tokens_per_s"] for run in runs[n]]
            cpu_ms = [run[variant]["cpu_ms_per_step"] for run in runs[n]]
            ratio = [a / b[variant]["tokens_per_s"] for a, b in zip(rate, runs[base])]
            cpu_ratio = [a / b[variant]["cpu_ms_per_step"] for a, b in zip(cpu_ms, runs[base])]
            losses = runs[n][0][variant]["losses"]
            rows.append([variant, n, round(statistics.median(ratio), 3), f"{min(ratio):.2f}-{max(ratio):.2f}",
                         round(statistics.median(rate)), round(statistics.median(cpu_ratio), 3),
                         round(statistics.median(cpu_ms), 1), " ".join(f"{x:.5f}" for x in losses)])
            figures[f"{variant}_{n}_tokens_per_s_ratio"] = round(statistics.median(ratio), 3)
            figures[f"{variant}_{n}_cpu_ratio"] = round(statistics.median(cpu_ratio), 3)
            print(f"  {variant:16s} {n:8s} tokens/s {statistics.median(ratio):.3f}x {base} "
                  f"({min(ratio):.2f}-{max(ratio):.2f}), median {statistics.median(rate):.0f}; CPU per step "
                  f"{statistics.median(cpu_ratio):.3f}x ({statistics.median(cpu_ms):.1f} ms); losses {losses}")
    if args.record:
        sys.path.insert(0, str(THIS_SRC))
        from moetrain.results import write_record

        command = " ".join(["python benchmarks/dp_before_after.py", *(f"--version {v}" for v in args.version),
                            f"--rounds {args.rounds} --steps {args.steps} --warmup {args.warmup} "
                            f"--layers {args.layers} --record"])
        path = write_record({
            "title": "Plain data parallel and ZeRO-3 under torchrun (2 gloo ranks): this checkout against "
                     + ", ".join(n for n in names if n != "this"),
            "section": "Scale-out", "cpu": f"{cpu}, {os.cpu_count()} cores shared with other jobs",
            "command": command, "figures": figures,
            "table": {"columns": ["variant", "version", f"tokens/s vs {base} (median of rounds)", "range",
                                  "tokens/s", f"CPU per step vs {base}", "CPU ms per step (both ranks)",
                                  "losses of steps 1-3"], "rows": rows},
            "notes": "; ".join(f"{n}: {src}" for n, src in versions.items())},
            directory=HERE.parent.parent / "results")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
