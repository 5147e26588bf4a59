"""Shared measurement helpers of the benchmarks (``bench moe``, ``bench train``, ``bench bta``): interleaved timing and
peak tensor memory.

Timing: every round runs each candidate once, in an order rotated by one each round, so that a busy machine (other
processes, frequency changes) slows all candidates alike and none always runs first after another's cache
pollution; the tables report the median over rounds and the min-max range.

Memory: CPU has no allocator statistics in PyTorch (``tracemalloc`` sees only Python objects), so
:func:`peak_tensor_bytes` replays one call under ``torch.profiler`` with ``profile_memory=True`` and takes the
peak of the running sum of its allocation events: the most bytes of torch tensors alive at once during the call,
above the level at its start (so weights and inputs allocated before are not counted; saved activations,
temporaries and gradients are; the scratch the fused MoE path keeps between calls, moe/kernels/cpu/workspace.py, is
released first so that it is counted too). It counts what PyTorch's CPU allocator hands out, not what the C library
keeps mapped (RSS). On CUDA it uses ``torch.cuda.max_memory_allocated`` the same way (peak minus start).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved_times(candidates: dict[str, Callable[[], None]], rounds: int, warmup: int,
                      sync: Callable[[], None] | None = None, clock: str = "wall") -> dict[str, list[float]]:
    """Seconds per call of each candidate over ``rounds`` timed rounds, after ``warmup`` untimed ones.

    Args:
        candidates: name -> a callable that does one unit of work (e.g. forward + backward).
        rounds: timed rounds (>= 1). warmup: untimed rounds first (>= 0).
        sync: called before each clock read (``torch.cuda.synchronize`` on GPU).
        clock: ``wall`` (elapsed time) or ``cpu`` (this process's CPU time, all threads: on a machine that other
            processes keep busy it counts only the time the work actually ran; meaningful with one thread, since
            with more it also counts threads waiting at barriers).
    Returns:
        name -> list of ``rounds`` durations in seconds.
    """
    now = CLOCKS[clock]
    names = list(candidates)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if sync:
                sync()
            t0 = now()
            candidates[name]()
            if sync:
                sync()
            if r >= warmup:
                times[name].append(now() - t0)
    return times


def summary(seconds: list[float]) -> dict[str, float]:
    """Median, min and max of a list of durations (seconds)."""
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


@contextlib.contextmanager
def _quiet_native_stderr():
    """Send file descriptor 2 to /dev/null for the block: kineto prints a ``USDT: ... profiler_start`` /
    ``profiler_stop`` line (and the CPU allocator a warning about blocks allocated before profiling) from C++ for
    every profiled call, which would interleave with the benchmark's table. Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_tensor_bytes(fn: Callable[[], None], device: torch.device | str = "cpu") -> int:
    """Most bytes of torch tensors alive at once while ``fn()`` runs, above the level at its start (module
    docstring). Runs ``fn`` once more (untimed)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - start)
    from torch.profiler import ProfilerActivity, profile

    from moetrain.moe.kernels.cpu import workspace

    workspace.clear()  # the fused MoE path's kept scratch is then allocated (and counted) inside the call
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        size = getattr(node.extra_fields, "alloc_size", None)
        if size is not None and getattr(node.extra_fields, "device", device).type == "cpu":
            events.append((node.start_time_ns, size))
    return max(itertools.accumulate((size for _, size in sorted(events, key=lambda e: e[0])), initial=0))


def cpu_line(info: dict) -> str:
    """``native CPU kernels on; CPU Intel(R) Xeon(R) Processor, native bf16: amx_bf16 avx512_bf16 (bf16 fast)``
    for a bench header, from :func:`machine_info`."""
    flags = " ".join(info["bf16_flags"]) or "none"
    return (f"native CPU kernels {'on' if info['native_cpu_kernels'] else 'off'}; CPU {info['cpu_model']}, native "
            f"bf16: {flags} (bf16 {'fast' if info['bf16_fast'] else 'slow'})")


def machine_info() -> dict:
    """What the numbers were measured on: the CPU (:func:`moetrain.runtime.cpu.cpu_info`), the load average at the time and whether the
    fused MoE path's native CPU kernels were in use (built here on the first call)."""
    from moetrain.moe.kernels.cpu import native as cpu_kernels
    from moetrain.runtime.cpu import cpu_info
    from moetrain.runtime.threads import load_average

    info: dict[str, object] = {
        "platform": platform.platform(),
        **cpu_info(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "native_cpu_kernels": cpu_kernels.available(),  # the fused MoE path's C kernels (moe/kernels/cpu/native.py)
        "load_avg_1_5_15min": load_average(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info
