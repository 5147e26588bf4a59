"""The default number of intra-op threads: the cores this process may use, less the machine's load.

PyTorch's default is one thread per core of the machine. On a machine busy with other jobs that oversubscribes
the cores: OpenMP threads spin-wait for each other at every parallel region, and one descheduled thread stalls
them all; the issue that introduced this module measured a 200-step ``tiny`` run at 100 s with the default and
19 s with one thread under a load of 4-6 on 2 cores. So the default is

    threads = max(1, min(current threads, usable cores - round(1-minute load average)))

where the current threads are PyTorch's (one per core, or what ``OMP_NUM_THREADS`` or an embedding program's
``torch.set_num_threads`` set: an explicit lower setting is kept), the usable cores are ``os.sched_getaffinity(0)`` (a container's or ``taskset``'s limit, not the machine's
core count) and the load is ``os.getloadavg()[0]`` (it counts runnable processes; this process is not running
yet when it is read, and a load above the cores leaves one thread). ``train.threads`` > 0 overrides it.

The choice depends on the load at start, so a resumed run may get another count than its first part, and GEMM
reductions split over another number of threads round differently: for bit-exact resumes set ``train.threads``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads chosen and what they were chosen from.

    Attributes:
        threads: what ``torch.set_num_threads`` got.
        usable_cores: ``len(os.sched_getaffinity(0))`` (``os.cpu_count()`` where unsupported).
        load: 1-minute load average (``None`` where unsupported).
        requested: ``train.threads`` (0 = choose).
    """

    threads: int
    usable_cores: int
    load: float | None
    requested: int

    def line(self) -> str:
        load = "unknown" if self.load is None else f"{self.load:.1f}"
        if self.requested:
            return f"threads: {self.threads} (train.threads; {self.usable_cores} usable cores, load average {load})"
        return (f"threads: {self.threads} ({self.usable_cores} usable cores, load average {load}; "
                "set train.threads=N to override)")


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, or ``None`` where the OS does not report one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def default_threads(cores: int, load: float | None) -> int:
    """``max(1, cores - round(load))``; all ``cores`` when the load is unknown."""
    if load is None:
        return cores
    return max(1, min(cores, cores - int(round(load))))


def choose_threads(requested: int = 0) -> ThreadChoice:
    """Pick the intra-op threads (``requested`` > 0 wins; else never more than PyTorch has now) and apply them
    with ``torch.set_num_threads``."""
    cores, load = usable_cores(), load_average()
    threads = requested if requested > 0 else min(torch.get_num_threads(), default_threads(cores, load))
    torch.set_num_threads(threads)
    return ThreadChoice(threads, cores, load, requested)
