"""The same benchmark on two versions of moetrain, interleaved: is a change faster, slower, or within the spread?

    python benchmarks/before_after.py --base REV [--rounds 5] train [bench train options]
    python benchmarks/before_after.py --base REV moe [bench moe options]
    python benchmarks/before_after.py --base REV serve RUN_DIR [serve_load.py options]
    python benchmarks/before_after.py --base REV dp [dp_steps.py options]

``REV`` (a commit, branch or tag) is checked out into a temporary git worktree; the working tree this script lives
in is the other version. Each round runs the benchmark once per version, as a subprocess whose ``PYTHONPATH`` points
at that version's ``src/`` (the order alternates round by round, so a load that drifts on a shared machine weighs on
both alike). Figures read from each run:

- ``train``: ``moetrain bench train --json``: tokens/s of every ``moetrain-*`` candidate (transformers'
  candidates are left out: ``--hf`` is set to none unless given);
- ``moe``: ``moetrain bench moe --json``: 1 / median seconds of every moetrain candidate per shape and dtype;
- ``serve``: ``benchmarks/serve_load.py RUN_DIR --no-record`` (this tree's script, the server from each version):
  tokens/s of each server configuration;
- ``dp``: ``torchrun --standalone --nproc_per_node 2 benchmarks/dp_steps.py`` (this tree's script, the trainer's
  hooks from each version): tokens/s and optimizer steps per CPU-second (both ranks) of plain data parallelism
  (``train.grad_accum`` 1 and 4) and FSDP2 ZeRO-3 (``parallel.dp_shard=2``).

Printed: each figure's per-round ratio head / base and the median over rounds; the CPU model and load average. With
``--record``, appended as a record to ``results/`` (``moetrain.results.write_record``). Nothing is asserted (speed
belongs here, not in tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this tree's moetrain for the record and the CPU model

from moetrain.runtime.cpu import cpu_model  # noqa: E402


def _run(src: Path, cmd: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (PYTHONPATH={src}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def _figures(kind: str, src: Path, extra: list[str], tmp: Path) -> dict[str, float]:
    """One benchmark run of the version at ``src``: figure name -> a speed (higher is faster)."""
    if kind == "serve":
        out = _run(src, [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), *extra, "--no-record"])
        record = json.loads(out[out.rfind("\n{\n") + 1:] if not out.startswith("{\n") else out)
        return {f"{group}: {server}": row["tokens_per_s"]
                for group, servers in record["figures"].items() for server, row in servers.items()
                if isinstance(row, dict) and "tokens_per_s" in row}
    out_json = tmp / f"{kind}.json"
    if kind == "dp":
        _run(src, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(ROOT / "benchmarks" / "dp_steps.py"), "--out", str(out_json), *extra])
        steps = json.loads(out_json.read_text())
        return {**{f"{v} tokens/s": r["tokens_per_s"] for v, r in steps.items()},
                **{f"{v} steps per CPU-s": 1e3 / r["cpu_ms_per_step"] for v, r in steps.items()}}
    hf = [] if kind != "train" or any(a.startswith("--hf") for a in extra) else ["--hf", ""]
    _run(src, [sys.executable, "-m", "moetrain", "bench", kind, *extra, *hf, "--json", str(out_json), "--overwrite"])
    report = json.loads(out_json.read_text())
    if kind == "train":
        return {name: c["tokens_per_s"] for name, c in report["candidates"].items() if name.startswith("moetrain")}
    return {f"{rec['label']} {rec['dtype']} {name}": 1.0 / c["median_s"]
            for rec in report["results"] for name, c in rec["candidates"].items()
            if name in ("loop", "padded", "grouped_mm", "fused")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against (checked out in a temporary worktree)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--record", action="store_true", help="append the figures to results/")
    p.add_argument("kind", choices=["train", "moe", "serve", "dp"])
    argv = sys.argv[1:]
    at = next((i for i, a in enumerate(argv) if a in ("train", "moe", "serve", "dp")), len(argv))
    args = p.parse_args(argv[:at + 1])  # what follows the kind is the benchmark's own (its --rounds too)
    extra = argv[at + 1:]
    with tempfile.TemporaryDirectory(prefix="moetrain-before-after-") as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        try:
            versions = {"base": base / "src", "head": ROOT / "src"}
            per_round: list[dict[str, dict[str, float]]] = []
            for r in range(args.rounds):
                order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                per_round.append({v: _figures(args.kind, versions[v], extra, tmp) for v in order})
                print(f"round {r + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    names = [n for n in per_round[0]["head"] if n in per_round[0]["base"]]
    rows = []
    print(f"\nCPU {cpu_model()}; head = this tree, base = {args.base}; ratio head / base per round (>1: head faster)")
    for name in names:
        ratios = [rd["head"][name] / rd["base"][name] for rd in per_round]
        med = statistics.median(ratios)
        rows.append([name, round(statistics.median(rd["base"][name] for rd in per_round), 2),
                     round(statistics.median(rd["head"][name] for rd in per_round), 2),
                     [round(x, 3) for x in ratios], round(med, 3)])
        print(f"  {name:<48} median {med:.3f}   rounds {' '.join(f'{x:.2f}' for x in ratios)}")
    if args.record:
        from moetrain.results import write_record

        path = write_record({"title": f"{args.kind} benchmark: this tree vs {args.base}, interleaved",
                             "section": {"train": "Training speed", "moe": "MoE layer speed", "serve": "Serving",
                                         "dp": "Scale-out"}[args.kind], "cpu": cpu_model(),
                             "command": " ".join(["python", "benchmarks/before_after.py", *sys.argv[1:]]),
                             "table": {"columns": ["figure", "base (median)", "head (median)",
                                                   "head / base per round", "median ratio"], "rows": rows}},
                            ROOT / "results", slug=f"before-after-{args.kind}", numbered=True)
        print(f"recorded in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
