"""Benchmarks run by ``moetrain bench NAME``: one module per benchmark (see moetrain/commands/bench.py)."""

import json
import os
import tempfile
import time
from pathlib import Path

from moetrain.errors import ConfigError

def default_output(bench: str) -> Path:
    """Where ``moetrain bench NAME`` writes its JSON without ``--json``: a new file
    ``<temp dir>/moetrain-bench/NAME-YYYYmmdd-HHMMSS-PID.json``, never the current directory and never an earlier
    result."""
    stem = Path(tempfile.gettempdir()) / "moetrain-bench" / f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path, n = stem.with_suffix(".json"), 1
    while path.exists():  # a second benchmark of this process within the second
        n += 1
        path = stem.with_name(f"{stem.name}-{n}.json")
    return path


def write_report(args, report: dict) -> None:
    """Write ``report`` as JSON to ``--json`` (its folder created), after the benchmark's name and the command's
    arguments, and say where."""
    out = {"benchmark": args.bench, "args": {k: v for k, v in vars(args).items() if k not in ("func", "debug")},
           **report}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


def add_json_arg(p) -> None:
    """``--json PATH`` (default ``None``: :func:`default_output`, chosen when the benchmark runs)."""
    p.add_argument("--json", default=None, help=f"output file (default: a new file under "
                   f"{Path(tempfile.gettempdir()) / 'moetrain-bench'}, printed at the end)")


def add_measurement_args(p) -> None:
    """argparse options ``bench moe`` and ``bench train`` share: device, memory pass, threads, clock, seed, output
    file."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where every candidate runs (default cpu); on cuda the timings synchronise the device")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: elapsed time (default); cpu: process CPU time (steadier on a busy machine with "
                        "--threads 1)")
    p.add_argument("--seed", type=int, default=0)
    add_json_arg(p)


def choose(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """The comma-separated names in ``text``, the value of ``--FLAG``; a ConfigError names any not in ``allowed``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ConfigError(f"--{flag}: unknown {unknown}; choose from {list(allowed)}")
    return names
