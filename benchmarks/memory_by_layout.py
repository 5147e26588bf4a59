"""Predicted vs measured per-rank peak memory for ZeRO-3, ZeRO-2, EP and PP at 1, 2 and 4 processes (CPU, gloo).

    python benchmarks/memory_by_layout.py [--data DIR] [--out results/] [--steps 2]

Each layout trains ``--steps`` steps of one ~26M-parameter MoE (hidden 256, 4 MoE blocks of 8 experts of width 1024;
weights + gradients + AdamW state 0.42 GB in one process) under ``torchrun --nproc_per_node N``. Predicted: the
busiest rank's peak of :func:`moetrain.parallel.memory.rank_memory` (what ``moetrain train --dry-run`` prints).
Measured: each rank's ``mem/rank{R}/peak_bytes - mem/rank{R}/baseline_bytes`` of the last ``metrics.jsonl`` record
(peak resident memory from the start of training minus the resident memory before the model was built:
train/memory_stats.py), the busiest rank's, with glibc's malloc set by :data:`ALLOCATOR` (``--glibc-defaults``:
not). Writes ``results/<date>-memory-by-layout[-glibc-defaults].json`` (a record of ``results/README.md``: title, date,
CPU model, commit, command, table, notes) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model.hidden=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=512",
         "model.moe.num_experts=8", "model.moe.experts.ffn_hidden=1024", "model.tie_embeddings=false"]
# glibc's malloc keeps a heap per thread (gloo's and autograd's threads each get one) and keeps freed buffers of it
# resident: with its defaults a sharded rank's peak resident memory measured 1.6-3.7x the model's (2026-12-07). One
# heap, trimmed at once, and mmap for buffers from 64 KB make the resident memory follow the live tensors.
ALLOCATOR = {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "65536"}
LAYOUTS = {"ZeRO-3": lambda n: [f"parallel.dp_shard={n}"],
           "ZeRO-2": lambda n: [f"parallel.dp_shard={n}", "parallel.reshard_after_forward=false"],
           "EP": lambda n: [f"parallel.ep={n}"],
           "PP": lambda n: [f"parallel.pp={n}"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def common(data: str, cache: Path, steps: int) -> list[str]:
    return ["--preset", "tiny", "--data", data, "--no-progress", f"data.cache_dir={cache}", f"train.steps={steps}",
            "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.ckpt_every=0", *MODEL]


def predicted(overrides: list[str], world: int) -> float:
    from moetrain.config import build_config
    from moetrain.configlib import parse_overrides
    from moetrain.parallel import microbatches
    from moetrain.parallel.memory import rank_memory

    config = build_config("tiny", overrides=parse_overrides(overrides))
    config, _ = microbatches.choose(config, world)  # as `moetrain train` does for PP
    return max(r.total for r in rank_memory(config, world))


def measured(run: Path) -> tuple[float, list[float]]:
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    ranks = sorted({int(k.split("/")[1][4:]) for k in last if k.startswith("mem/rank")})
    added = [last[f"mem/rank{r}/peak_bytes"] - last[f"mem/rank{r}/baseline_bytes"] for r in ranks]
    return max(added), added


def main() -> int:
    from moetrain.runtime.cpu import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=None, help="a text corpus (default: the Python standard library)")
    ap.add_argument("--out", default="results", help="folder of the JSON record (default results/)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="leave glibc's malloc settings alone (default: set ALLOCATOR in every process)")
    args = ap.parse_args()
    data = args.data or os.path.dirname(os.__file__)
    tmp = Path(tempfile.mkdtemp(prefix="memory_by_layout-"))
    allocator = {} if args.glibc_defaults else ALLOCATOR
    env = {**os.environ, "OMP_NUM_THREADS": "1", **allocator}
    rows = []
    sizes = [int(n) for n in args.sizes.split(",")]
    for n in sizes:
        for name, layout in LAYOUTS.items():
            if n == 1 and name != "ZeRO-3":
                continue  # one process: one row (no sharding, no pipeline)
            extra = layout(n) if n > 1 else []
            label = name if n > 1 else "one process"
            out = tmp / f"{label.replace(' ', '_')}_{n}"
            cmd = ["-m", "moetrain", "train", *common(data, tmp / "cache", args.steps), "--out", str(out), *extra]
            if n > 1:
                cmd = ["-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
                       "--master_port", str(free_port()), *cmd]
            proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(proc.stdout[-2000:] + proc.stderr[-3000:], file=sys.stderr)
                return 1
            want = predicted([*MODEL, *extra], n)
            got, per_rank = measured(out)
            rows.append({"layout": label, "processes": n, "overrides": extra, "predicted_bytes": want,
                         "measured_bytes": got, "measured_per_rank_bytes": per_rank,
                         "ratio": got / want, "command": shlex.join(["python", *cmd])})
            print(f"{label:12s} x{n}: predicted {want / 1e6:7.1f} MB, measured {got / 1e6:7.1f} MB "
                  f"({got / want:.2f})", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = datetime.date.today().isoformat()
    env_words = " ".join(f"{k}={v}" for k, v in allocator.items()) or "glibc malloc defaults"
    which = "glibc defaults" if args.glibc_defaults else "glibc heap set"
    record = {"title": f"Per-rank memory by layout: predicted vs measured ({which})",
              "section": "Memory", "date": date, "cpu": cpu_model(), "commit": commit,
              "command": shlex.join(["python", *sys.argv]),
              "table": {"columns": ["layout", "processes", "predicted MB", "measured MB", "measured / predicted",
                                    "overrides"],
                        "rows": [[r["layout"], r["processes"], round(r["predicted_bytes"] / 1e6, 1),
                                  round(r["measured_bytes"] / 1e6, 1), round(r["ratio"], 2),
                                  " ".join(r["overrides"]) or "(none)"] for r in rows]},
              "notes": ("Per-rank peak memory that training adds, busiest rank: predicted by moetrain.parallel.memory "
                        "(sharded state, FSDP2's gathered copies and collective buffers with gloo's copies, "
                        "activations, the MoE scratch kept between calls, the runtime constant), "
                        "measured as peak resident memory minus the resident memory before the model was built "
                        f"(mem/rank*/peak_bytes - baseline_bytes). Model: tiny preset with {' '.join(MODEL)}; "
                        f"{args.steps} steps of 8 x 64 tokens, fp32, gloo, one thread per process; allocator: "
                        f"{env_words}.")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    suffix = "-glibc-defaults" if args.glibc_defaults else ""
    path = Path(args.out) / f"{date}-memory-by-layout{suffix}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\n{cpu_model()}; per-rank peak added by training (busiest rank)\n")
    print("| layout | processes | predicted MB | measured MB | measured / predicted |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['processes']} | {r['predicted_bytes'] / 1e6:.1f} | "
              f"{r['measured_bytes'] / 1e6:.1f} | {r['ratio']:.2f} |")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
