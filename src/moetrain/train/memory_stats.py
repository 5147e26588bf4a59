"""Each rank's measured memory for ``metrics.jsonl`` (``mem/rank{R}/peak_bytes``, ``baseline_bytes`` and
``tensor_bytes``: docs/scale-out.md, "Per-rank memory"), gathered from all ranks by one ``all_gather_object`` per
logging step. The CPU peak is ``VmHWM``, reset to the current resident memory through ``/proc/self/clear_refs`` when
training starts (``ru_maxrss`` where ``/proc`` is missing).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import torch

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int:
    """``key`` of ``/proc/self/status`` in bytes; where it cannot be read, the peak resident memory (``ru_maxrss``)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak(device: torch.device) -> int:
    """Start a new peak and return the baseline: the memory in use now (bytes; CUDA allocated, CPU resident)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
    except OSError:
        pass
    return _status_bytes("VmRSS")


def peak_bytes(device: torch.device) -> int:
    """This process's peak since :func:`reset_peak` (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_bytes("VmHWM")


def tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of ``model``'s parameters and gradients and ``optimizer``'s state tensors held by this rank."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    states = optimizer.state.values() if optimizer is not None else []
    tensors += [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]
    seen: set[tuple[int, int, int]] = set()  # storage, offset, size: DTensor.to_local() returns a new object
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), t.numel()) if not t.is_meta else (0, 0, 0)
        if t.is_meta or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def memory_record(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device,
                  baseline: int) -> dict[str, Any]:
    """The ``mem/rank{R}/...`` fields of every rank (a collective when a process group exists: call it on every
    rank at the same step)."""
    import torch.distributed as dist

    mine = (peak_bytes(device), baseline, tensor_bytes(model, optimizer))
    everyone: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized():
        from moetrain.parallel.comm import named_collective

        everyone = [None] * dist.get_world_size()
        with named_collective("all_gather_object (per-rank memory figures)"):
            dist.all_gather_object(everyone, mine)
    out: dict[str, Any] = {}
    for rank, (peak, base, held) in enumerate(everyone):
        out.update({f"mem/rank{rank}/peak_bytes": peak, f"mem/rank{rank}/baseline_bytes": base,
                    f"mem/rank{rank}/tensor_bytes": held})
    return out
