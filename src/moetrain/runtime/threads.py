"""The default number of intra-op threads: the cores this process may use, less those other processes keep busy
(``max(1, min(current threads, usable cores - round(busy)))``; the rule, its inputs and why: docs/robustness.md,
"Threads"). ``train.threads`` > 0 overrides the choice.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads chosen and what they were chosen from.

    Attributes:
        threads: what ``torch.set_num_threads`` got.
        usable_cores: ``len(os.sched_getaffinity(0))`` (``os.cpu_count()`` where unsupported).
        load: 1-minute load average (``None`` where unsupported).
        requested: ``train.threads`` (0 = choose).
        busy: usable cores that other processes kept busy when the choice was made (:func:`others_busy_cores`;
            ``None`` where unsupported, or not measured because nothing was left to choose).
    """

    threads: int
    usable_cores: int
    load: float | None
    requested: int
    busy: float | None = None

    def line(self) -> str:
        load = "unknown" if self.load is None else f"{self.load:.1f}"
        if self.requested:
            return f"threads: {self.threads} (train.threads; {self.usable_cores} usable cores, load average {load})"
        busy = "" if self.busy is None else f", {self.busy:.1f} of them busy with other processes"
        return (f"threads: {self.threads} ({self.usable_cores} usable cores{busy}, load average {load}; "
                "set train.threads=N to override)")


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded to 0.01; ``None`` where the OS does not report them."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_ticks(cpus: set[int]) -> int | None:
    """Busy clock ticks (user, nice, system, irq, softirq, steal; guest time is inside user) summed over ``cpus``,
    from ``/proc/stat``; ``None`` unless every one of ``cpus`` has a line there (an offline CPU, or a container
    whose ``/proc/stat`` numbers its CPUs otherwise than the affinity does) and every line parses."""
    try:
        found, total = set(), 0
        for line in Path("/proc/stat").read_text().splitlines():
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in rest.split()[:8])
                total += user + nice + system + irq + softirq + steal
                found.add(int(name[3:]))
    except (OSError, ValueError):
        return None
    return total if found == cpus else None


def _own_ticks() -> int | None:
    """This process's CPU time (all threads, user + system) in clock ticks, from ``/proc/self/stat``."""
    try:
        stat = Path("/proc/self/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    except (OSError, ValueError, IndexError):
        return None


def others_busy_cores(sample_s: float = 0.1) -> float | None:
    """How many of this process's usable cores other processes keep busy now.

    Samples the busy ticks of the usable CPUs (``/proc/stat``) and this process's own CPU time
    (``/proc/self/stat``) ``sample_s`` seconds apart; the difference, over the elapsed ticks, is the cores busy
    with everything but this process (its own OpenMP threads, still spinning after its last parallel region,
    included in its own time). Tick resolution is 1 / ``SC_CLK_TCK`` (10 ms on Linux).

    Args:
        sample_s: sampling window in seconds.
    Returns:
        cores in [0, usable cores], or ``None`` where the counters do not exist (not Linux).
    """
    try:
        cpus = set(os.sched_getaffinity(0))
        hz = os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):
        return None
    t0, busy0, own0 = time.monotonic(), _cpu_ticks(cpus), _own_ticks()
    if busy0 is None or own0 is None:
        return None
    time.sleep(sample_s)
    t1, busy1, own1 = time.monotonic(), _cpu_ticks(cpus), _own_ticks()
    if busy1 is None or own1 is None:
        return None
    others = ((busy1 - busy0) - (own1 - own0)) / ((t1 - t0) * hz)
    return min(float(len(cpus)), max(0.0, others))


def default_threads(cores: int, load: float | None) -> int:
    """``max(1, cores - round(load))``, halves rounded up; all ``cores`` when the load is unknown. ``load``: cores
    busy with other work (:func:`others_busy_cores`, or the load average where that is unknown)."""
    if load is None:
        return cores
    return max(1, min(cores, cores - math.floor(load + 0.5)))


def choose_threads(requested: int = 0) -> ThreadChoice:
    """Pick the intra-op threads (``requested`` > 0 wins; else never more than PyTorch has now, and the usable
    cores less those other processes keep busy) and apply them with ``torch.set_num_threads``."""
    loads = load_average()
    cores, load = usable_cores(), loads[0] if loads else None
    current = torch.get_num_threads()
    busy = others_busy_cores() if requested <= 0 and min(current, cores) > 1 else None
    threads = requested if requested > 0 else min(current, default_threads(cores, load if busy is None else busy))
    torch.set_num_threads(threads)
    return ThreadChoice(threads, cores, load, requested, busy)


def serving_threads() -> int:
    """The intra-op threads of ``moetrain serve`` when ``--threads`` is not given: the usable cores less one, kept
    for the HTTP front (the event loop, JSON, tokenization: Python that needs the GIL and a core of its own), at
    least 1 and never more than PyTorch has now (``OMP_NUM_THREADS``, torchrun's one per process, is kept).
    Why: the engine's step is hundreds of small ops, and every one that starts an OpenMP parallel region waits at
    its barrier for a worker that shares its core with the event loop and the clients."""
    return max(1, min(torch.get_num_threads(), usable_cores() - 1))
