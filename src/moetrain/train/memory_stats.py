"""Each rank's measured memory, for ``metrics.jsonl``: what :mod:`moetrain.parallel.memory` predicts, measured
(docs/scale-out.md, "Per-rank memory"), gathered from all ranks (one ``all_gather_object`` per logging step):

- ``mem/rank{R}/peak_bytes``: CUDA ``torch.cuda.max_memory_allocated``; CPU the peak resident memory (``VmHWM``,
  reset to the current resident memory when training starts through ``/proc/self/clear_refs``; else ``ru_maxrss``).
- ``mem/rank{R}/baseline_bytes``: the same just before the model is built (``peak - baseline``: what training
  added).
- ``mem/rank{R}/tensor_bytes``: this rank's parameters, live gradients and optimizer state (local shards).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import torch

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def reset_peak(device: torch.device) -> int:
    """Start a new peak and return the baseline (bytes, see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
    except OSError:
        pass
    rss = _status_bytes("VmRSS")
    return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_bytes(device: torch.device) -> int:
    """This process's peak since :func:`reset_peak` (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of ``model``'s parameters and gradients and ``optimizer``'s state tensors held by this rank."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    seen: set[tuple[int, int, int]] = set()  # storage, offset, size: DTensor.to_local() returns a new object
    total = 0
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    for t in tensors:
        t = local(t)
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
