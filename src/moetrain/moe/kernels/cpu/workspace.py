"""Scratch memory kept between calls (CPU) for the fused MoE path and the fused LM-head loss (model/fused_ce.py):
buffers that live only inside one call (never anything saved for backward or returned).

Why: glibc serves large blocks with fresh pages and unmaps them on free, so each call's multi-MiB temporaries were
faulted in again page by page (about a third of a bf16 forward at E = 64, K = 8). Off the CPU the device's caching
allocator does this already.

A buffer is private to a (thread, name, dtype, device), so the fused path's workers never share one; it only grows
and is held until :func:`clear` (:func:`held_bytes` says how much). Benchmarks that count peak memory clear it
first (moetrain/bench/common.py).
"""

from __future__ import annotations

import math
import threading

import torch

from moetrain.moe.kernels.cpu import hugepages

_buffers: dict[tuple[int, str, torch.dtype, torch.device], torch.Tensor] = {}
_lock = threading.Lock()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` that is valid until the calling thread asks for ``name``
    again (same dtype and device). Off the CPU a fresh ``torch.empty`` (device allocators cache already)."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    key = (threading.get_ident(), name, dtype, device)
    buf = _buffers.get(key)  # read without the lock (one dict read is atomic): a decode step asks a dozen times
    if buf is not None and buf.numel() >= numel:
        return buf[:numel].view(shape)
    with _lock:
        buf = _buffers.get(key)
        if buf is None or buf.numel() < numel:
            # A normal tensor even when first asked for under torch.inference_mode(): an inference tensor could not
            # be written by a later call outside it (a training step after an evaluation).
            with torch.inference_mode(False):
                buf = hugepages.advise(torch.empty(numel, dtype=dtype, device=device), kept=True)
            if type(buf) is not torch.Tensor:  # a tensor subclass from a dispatch mode (fake tensors): never kept
                return buf.view(shape)
            _buffers[key] = buf
    return buf[:numel].view(shape)


def held_bytes() -> int:
    """Bytes held by all threads' scratch buffers."""
    with _lock:
        return sum(b.numel() * b.element_size() for b in _buffers.values())


def clear() -> None:
    """Release every held buffer (their memory returns to the allocator once no view of them is alive)."""
    with _lock:
        _buffers.clear()
