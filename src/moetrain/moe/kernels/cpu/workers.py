"""Independent pieces of CPU work on single-threaded workers, one per intra-op thread (expert-level parallelism).

Why (measured in docs/performance.md): the fused MoE path (moe/fast_moe.py) runs one GEMM per expert; each such op
run with PyTorch's intra-op threads splits its small problem across the cores and waits at a barrier for the
slowest. Giving each core whole blocks of experts instead, single-threaded with no barrier until the end, made the
layer up to 1.4x faster at E = 64.

Results do not depend on the scheduling: every item (a block of experts) writes its own rows and its own experts'
weight gradients. The calling thread is one of the workers. While they run, PyTorch's intra-op thread count is 1
(process-wide state), then restored. Each worker runs without gradient tracking, under the caller's
``torch.inference_mode`` state (thread-local: a worker outside it may not write a buffer allocated inside it).

The workers are PyTorch's own OpenMP threads where PyTorch runs on an OpenMP runtime this module can find (Linux,
``GOMP_parallel``, which libgomp, Intel's and LLVM's runtimes provide; why: docs/performance.md): one parallel region
started through ``ctypes`` with a Python callback per thread. Otherwise (``MOETRAIN_OMP_TEAM=0``, a forked child:
libgomp's threads do not survive a fork) a thread pool of this module's own.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_pools: dict[int, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _forget_pools() -> None:
    global _team, _team_known
    _pools.clear()  # a forked child has none of the parent's threads
    # nor libgomp's: a parallel region in the child waits forever for them (plain PyTorch ops at 2 threads hang in a
    # forked child too, once the parent has run one); the child's MoE workers are a thread pool of its own
    _team, _team_known = None, True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _pool(workers: int) -> ThreadPoolExecutor:
    with _lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="moetrain-moe")
        return _pools[workers]


_TEAM_LIBRARY = re.compile(r"lib(gomp|iomp5|omp)\b[^/]*\.so[^/]*$")
_Callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_team: Callable[[Callable[[], None], int], None] | None = None
_team_known = False


def _find_team() -> Callable[[Callable[[], None], int], None] | None:
    """``run(fn, threads)``: ``fn()`` on every thread of one OpenMP parallel region of the runtime PyTorch
    has loaded (its ``GOMP_parallel``), or None: not Linux, PyTorch's parallel backend is not OpenMP, no such
    runtime is loaded, or ``MOETRAIN_OMP_TEAM=0``. Prefers a runtime inside PyTorch's own directory (another
    package may have loaded a second one)."""
    if (sys.platform != "linux" or os.environ.get("MOETRAIN_OMP_TEAM", "1") == "0"
            or "parallel backend: OpenMP" not in torch.__config__.parallel_info()):
        return None
    try:
        with open("/proc/self/maps") as maps:
            loaded = {line.split(maxsplit=5)[-1].strip() for line in maps if _TEAM_LIBRARY.search(line.strip())}
    except OSError:
        return None
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    for path in sorted(loaded, key=lambda p: not p.startswith(torch_dir)):
        try:  # RTLD_NOLOAD: the copy already loaded, never a second one
            parallel = ctypes.CDLL(path, mode=os.RTLD_NOLOAD).GOMP_parallel
        except (OSError, AttributeError):
            continue
        parallel.argtypes = [_Callback, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        parallel.restype = None

        def run(fn: Callable[[], None], threads: int, parallel: Any = parallel) -> None:
            callback = _Callback(lambda _data: fn())  # fn must not raise: ctypes would print and drop the error
            parallel(callback, None, threads, 0)  # ctypes releases the GIL; the callbacks take it back

        return run
    return None


def _openmp_team() -> Callable[[Callable[[], None], int], None] | None:
    global _team, _team_known
    with _lock:
        if not _team_known:
            _team, _team_known = _find_team(), True
        return _team


def workers_for(device: torch.device) -> int:
    """How many single-threaded workers :func:`run_largest_first` would use on ``device`` (1 = run inline)."""
    return torch.get_num_threads() if device.type == "cpu" else 1


def run_largest_first(fn: Callable[[T], None], items: Sequence[T], sizes: Sequence[int]) -> None:
    """``fn(item)`` for every item, on single-threaded workers that each take the largest item left whenever they
    are free (a shared queue), when PyTorch has several intra-op threads; inline otherwise. ``fn`` runs without
    gradient tracking, in the caller's ``torch.inference_mode`` state (see the module docstring). Re-raises the
    first exception (the other workers stop at their next item), also an interrupt of the wait, and only once every
    worker has stopped (they write into the caller's buffers).

    A queue rather than a fixed split: a worker that falls behind (a shared core, a busy expert) takes fewer items
    instead of holding up the others (cpu-small fp32 step, 2 threads: ~110 ms waiting with a fixed split, ~50 ms).
    """
    order = sorted(range(len(items)), key=lambda i: -sizes[i])
    threads = torch.get_num_threads()
    if threads < 2 or len(items) < 2:
        with torch.no_grad():
            for i in order:
                fn(items[i])
        return
    queue = iter(order)
    inference = torch.is_inference_mode_enabled()  # thread-local: each worker enters it again
    lock = threading.Lock()
    failed = threading.Event()
    team = _openmp_team()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            torch.set_num_threads(1)
            with torch.inference_mode() if inference else torch.no_grad():
                while not failed.is_set():
                    with lock:
                        i = next(queue, None)
                    if i is None:
                        return
                    fn(items[i])
        except BaseException as exc:  # also a KeyboardInterrupt between items: the others stop too
            failed.set()
            if team is None:
                raise
            errors.append(exc)  # a callback from OpenMP must not raise; re-raised once the region has ended

    workers = min(threads, len(items))
    torch.set_num_threads(1)
    try:
        if team is not None:
            team(work, workers)  # returns once every thread of the region has stopped
        else:
            futures = [_pool(threads - 1).submit(work) for _ in range(workers - 1)]
            try:
                work()
            finally:
                for future in futures:
                    while True:  # until the worker has stopped: it writes into the caller's (kept) buffers
                        try:
                            future.result()
                            break
                        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every worker stopped
                            errors.append(exc)
                            if future.done():
                                break
                            failed.set()  # the wait itself was interrupted (Ctrl-C): stop the workers, wait again
        if errors:
            raise errors[0]
    finally:
        torch.set_num_threads(threads)
