"""A 100-step ``tiny`` run under an artificial load of N busy processes, for train.threads in {1, 2, default}
(issue 20: the default must be within 1.5x of the best setting). Prints a table with the CPU model, the usable
cores and the load average, and writes it as JSON.

    python benchmarks/threads_under_load.py --busy 2 --repeats 2 --out threads.json
    python benchmarks/threads_under_load.py --busy 2 --repeats 1 --timeout 120   # a run past 120 s is stopped

Each run is a fresh ``moetrain train`` process (the thread default is chosen at its start); settings are
interleaved over the repeats and the median wall time of the training steps (the run's own summary line) is
reported, so start-up and data preparation are left out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _run(threads: str, corpus: Path, work: Path, steps: int, timeout: float) -> tuple[float, str, bool]:
    """(seconds of the training steps, threads chosen, timed out); a run stopped at ``timeout`` s of wall time
    counts as ``timeout`` (a lower bound)."""
    out = Path(tempfile.mkdtemp(dir=work))
    argv = [sys.executable, "-m", "moetrain", "train", "--preset", "tiny", "--data", str(corpus), "--out",
            str(out / "run"), "--steps", str(steps), "--no-progress", f"data.cache_dir={work / 'cache'}",
            "train.eval_every=0", "train.ckpt_every=0", "train.log_every=50"]
    if threads != "default":
        argv.append(f"train.threads={threads}")
    try:
        text = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=timeout or None).stdout
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        chosen = re.search(r"threads: (\d+)", partial)
        return timeout, chosen.group(1) if chosen else "?", True
    m = re.search(r"trained \d+ steps in ([\dhms.]+)", text)
    chosen = re.search(r"threads: (\d+)", text).group(1)
    return _seconds(m.group(1)), chosen, False


def _seconds(text: str) -> float:
    if text.endswith("s") and "m" not in text:
        return float(text[:-1])
    h = int(text.split("h")[0]) if "h" in text else 0
    rest = text.split("h")[-1]
    m, s = rest.rstrip("s").split("m")
    return 3600 * h + 60 * int(m) + float(s)


def main() -> None:
    from moetrain.runtime.cpu import bf16_flags, cpu_model
    from moetrain.runtime.threads import usable_cores

    p = argparse.ArgumentParser()
    p.add_argument("--busy", type=int, default=2, help="busy processes started beside the runs")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--corpus", help="text file (default: 200 KB of the Python standard library's os.py & co)")
    p.add_argument("--timeout", type=float, default=0, help="stop a run after this many seconds (0: never)")
    p.add_argument("--out", help="write the table as JSON here")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="threads-"))
    corpus = Path(a.corpus) if a.corpus else work / "corpus.txt"
    if not a.corpus:
        import inspect
        import json as j
        import os as o

        corpus.write_text("".join(inspect.getsource(m) for m in (o, j, argparse, subprocess, statistics)))
    _run("1", corpus, work, 2, 0)  # data cache and tokenizer, outside the timings
    load_before = os.getloadavg()[0]
    stop = mp.Event()
    busy = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.busy)]
    for b in busy:
        b.start()
    time.sleep(5)  # let the load average see them
    times: dict[str, list[float]] = {"1": [], "2": [], "default": []}
    chosen, stopped = {}, {k: False for k in times}
    try:
        for _ in range(a.repeats):
            for setting in times:
                t, c, out = _run(setting, corpus, work, a.steps, a.timeout)
                times[setting].append(t)
                chosen[setting] = c
                stopped[setting] |= out
    finally:
        stop.set()
        for b in busy:
            b.join()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(med.values())
    table = {"cpu": cpu_model(), "bf16_flags": bf16_flags(), "usable_cores": usable_cores(),
             "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
             "busy_processes": a.busy, "steps": a.steps, "date": time.strftime("%Y-%m-%d"),
             "settings": {k: {"threads": chosen[k], "seconds": times[k], "median_s": med[k],
                              "vs_best": med[k] / best, "stopped_at_timeout": stopped[k]} for k in times}}
    print(f"{table['date']} CPU {table['cpu']} ({', '.join(table['bf16_flags']) or 'no native bf16'}), "
          f"{table['usable_cores']} usable cores, {a.busy} busy processes, load average "
          f"{load_before:.1f} before them, {table['load_average_after']:.1f} at the end; {a.steps}-step tiny run, "
          f"median of {a.repeats}")
    print(f"{'train.threads':>14} {'threads':>8} {'median s':>9} {'vs best':>8}")
    for k, row in table["settings"].items():
        bound = ">=" if row["stopped_at_timeout"] else ""  # stopped: the time is a lower bound
        print(f"{k:>14} {row['threads']:>8} {bound + format(row['median_s'], '.2f'):>9} "
              f"{bound + format(row['vs_best'], '.2f'):>8}")
    if a.out:
        Path(a.out).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
