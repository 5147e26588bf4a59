"""Where a rank's peak memory goes: every buffer of a training step from 64 KB, traced, beside the per-rank model.

    python benchmarks/memory_timeline.py [--nproc 2] [--data DIR] [--steps 2] [--out DIR] [OVERRIDE ...]

e.g. ``python benchmarks/memory_timeline.py --nproc 2 parallel.dp_shard=2`` (about a minute on 2 cores). Trains
memory_by_layout.py's model under ``torchrun --nproc_per_node N`` with glibc's malloc set as there
(:data:`memory_by_layout.ALLOCATOR`): every allocation from 64 KB (each tensor of this model, and gloo's buffers) is
then an ``mmap`` of its own, so ``strace -f -e trace=mmap,munmap,mremap`` of a rank gives its live bytes at every
moment, from every thread. Each rank marks the moments with an ``access("/moetrain-mark/...")`` call (a no-op that
strace records): the start (before the model is built), the model's build, the evaluations, every FSDP2
``record_function`` range (all-gather, copy-out, reduce-scatter, per unit), the pipeline's actions, each block's
forward, the backward, the optimizer step, the fused MoE path's scratch requests and the trainer's memory record.
Prints, per rank, the largest live bytes above the start before the last memory record (what
``mem/rank{R}/peak_bytes`` covers), the ranges open at that moment and the live bytes by where they were allocated;
then :func:`moetrain.parallel.memory.rank_memory`'s lines for the layout. Needs ``strace`` (Linux). Interpreter
arenas (1 MiB) and thread stacks are left out: the model's runtime term counts them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MARK = "/moetrain-mark/"


def mark(label: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.access(MARK + label.replace(" ", "_"), os.F_OK)


@contextlib.contextmanager
def marked(label: str) -> Iterator[None]:
    mark("B " + label)
    try:
        yield
    finally:
        mark("E " + label)


def _wrap(owner: Any, attr: str, label: Callable[..., str]) -> None:
    inner = getattr(owner, attr)

    def call(*args: Any, **kwargs: Any) -> Any:
        with marked(label(*args, **kwargs)):
            return inner(*args, **kwargs)

    setattr(owner, attr, call)


def install_marks() -> None:
    """Mark the moments named in the module docstring (wraps torch's and moetrain's functions in this process)."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.pipelining import schedules

    from moetrain.model.block import Block
    from moetrain.moe import fast_moe
    from moetrain.moe.kernels.cpu import workspace
    from moetrain.train import memory_stats
    from moetrain.train.trainer import Trainer

    for module in (_fsdp_param_group, schedules):
        record = module.record_function

        def ranged(name: str, *args: Any, _record: Any = record, **kwargs: Any) -> Any:
            @contextlib.contextmanager
            def both() -> Iterator[None]:
                with marked(name), _record(name, *args, **kwargs):
                    yield
            return both()

        module.record_function = ranged  # type: ignore[attr-defined]
    _wrap(torch.optim.AdamW, "step", lambda *a, **k: "optimizer step")
    _wrap(torch.autograd, "backward", lambda *a, **k: "backward")
    _wrap(Block, "forward", lambda *a, **k: "block forward")
    _wrap(Trainer, "_build_state", lambda *a, **k: "model build")
    _wrap(Trainer, "_evaluate", lambda *a, **k: "evaluation")
    scratch = workspace.scratch
    fast_moe.scratch = lambda name, *a, **k: _scratch(scratch, name, *a, **k)  # type: ignore[assignment]
    reset, record = memory_stats.reset_peak, memory_stats.memory_record

    def reset_peak(device: Any) -> int:
        mark("START")
        return reset(device)

    def memory_record(*args: Any, **kwargs: Any) -> Any:
        mark("RECORD")
        return record(*args, **kwargs)

    memory_stats.reset_peak, memory_stats.memory_record = reset_peak, memory_record  # type: ignore[assignment]


def _scratch(inner: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    with marked("MoE scratch " + name):
        return inner(name, *args, **kwargs)


_LINE = re.compile(r"^(\d+)\s+([\d.]+)\s+(.*)$")


def parse(path: Path) -> dict[str, Any]:
    """The peak of live anonymous mmapped bytes above the START mark, up to the last RECORD mark, with the ranges
    open then and the live bytes by the ranges open when each buffer was mapped."""
    pending: dict[str, str] = {}
    calls = []
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        pid, rest = m.group(1), m.group(3)
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[: -len("<unfinished ...>")]
            continue
        if rest.startswith("<..."):
            rest = pending.pop(pid, "") + rest.split("resumed>", 1)[1]
        calls.append(rest)
    last_record = max((i for i, c in enumerate(calls) if c.startswith(f'access("{MARK}RECORD')), default=len(calls))
    live: dict[int, tuple[int, str]] = {}
    opened: list[str] = []
    start = None
    peak: dict[str, Any] = {"bytes": 0, "open": [], "by_site": {}}
    for c in calls[:last_record + 1]:
        if c.startswith("mmap("):
            args, ret = c[5:c.rindex(")")].split(", "), c[c.rindex("=") + 1:].strip()
            if (ret.startswith("0x") and args[4] == "-1" and "MAP_ANONYMOUS" in args[3] and args[2] != "PROT_NONE"
                    and "MAP_STACK" not in args[3] and "MAP_FIXED" not in args[3] and int(args[1]) != 1 << 20):
                site = " > ".join(opened[-2:]) or "(outside the marked ranges)"
                live[int(ret, 16)] = (int(args[1]), site if start is not None else "before the model")
        elif c.startswith("munmap("):
            a, n = (int(x, 0) for x in c[7:c.rindex(")")].split(", "))
            for base, (size, site) in list(live.items()):
                if base <= a < base + size:  # the whole mapping, or its head or tail (an aligned allocation)
                    del live[base]
                    if a > base:
                        live[base] = (a - base, site)
                    if a + n < base + size:
                        live[a + n] = (base + size - a - n, site)
                    break
        elif c.startswith("mremap("):
            args, ret = c[7:c.rindex(")")].split(", "), c[c.rindex("=") + 1:].strip()
            old = int(args[0], 16)
            if old in live and ret.startswith("0x"):
                live[int(ret, 16)] = (int(args[2]), live.pop(old)[1])
        elif c.startswith(f'access("{MARK}'):
            label = c[len(f'access("{MARK}'):c.index('"', 9)].replace("_", " ")
            if label == "START":
                start = sum(size for size, _ in live.values())
            elif label.startswith("B "):
                opened.append(label[2:])
            elif label.startswith("E ") and label[2:] in opened:
                del opened[len(opened) - 1 - opened[::-1].index(label[2:])]
        if start is None:
            continue
        now = sum(size for size, _ in live.values()) - start
        if now > peak["bytes"]:
            sites: collections.Counter[str] = collections.Counter()
            for size, site in live.values():
                sites[site] += size
            peak = {"bytes": now, "open": list(opened), "by_site": dict(sites)}
    return peak


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory_by_layout import ALLOCATOR, MODEL, common, free_port

    if len(sys.argv) > 1 and sys.argv[1] == "--worker":  # one rank, under strace
        install_marks()
        from moetrain.cli import main as cli

        return cli(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--data", default=None, help="a text corpus (default: the Python standard library)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for the traces (default: a new temporary one)")
    ap.add_argument("overrides", nargs="*", help="FIELD=VALUE of the layout, e.g. parallel.dp_shard=2")
    args = ap.parse_args()
    if shutil.which("strace") is None:
        print("memory_timeline: needs strace (apt-get install strace)", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="memory_timeline-"))
    out.mkdir(parents=True, exist_ok=True)
    data = args.data or os.path.dirname(os.__file__)
    train = ["train", *common(data, out / "cache", args.steps), "--out", str(out / "run"), *MODEL, *args.overrides]
    rank = ('exec strace -f -ttt -e trace=mmap,munmap,mremap,access -o "$0/trace.$RANK" '
            f'{sys.executable} {Path(__file__).resolve()} --worker "$@"')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "--no-python", "sh", "-c", rank, str(out), *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **ALLOCATOR}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(proc.stdout[-2000:] + proc.stderr[-3000:], file=sys.stderr)
        return 1
    mb = 1e6
    for r in range(args.nproc):
        peak = parse(out / f"trace.{r}")
        print(f"rank {r}: peak {peak['bytes'] / mb:.1f} MB of buffers from 64 KB above the start; open: "
              f"{' > '.join(peak['open']) or '(none)'}")
        for site, size in sorted(peak["by_site"].items(), key=lambda kv: -kv[1]):
            if site != "before the model" and size >= 0.1 * mb:
                print(f"  {size / mb:8.1f} MB  allocated in {site}")
    from moetrain.config import build_config
    from moetrain.configlib import parse_overrides
    from moetrain.parallel import microbatches
    from moetrain.parallel.memory import memory_lines

    config, _ = microbatches.choose(build_config("tiny", overrides=parse_overrides([*MODEL, *args.overrides])),
                                    args.nproc)
    print("\n" + "\n".join(memory_lines(config, args.nproc, device="cpu")))
    print(f"\ntraces: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
