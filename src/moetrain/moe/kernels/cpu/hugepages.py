"""Transparent huge pages for the fused MoE path's large CPU buffers (Linux ``madvise(MADV_HUGEPAGE)``; about 4% off
the layer's time, docs/performance.md).

Why: glibc's ``malloc`` (PyTorch's CPU allocator) maps large blocks afresh, so a fresh buffer is faulted in 4 KiB at
a time; most Linux systems give 2 MiB pages only to regions the program asks them for. Unlike PyTorch's own
``THP_MEM_ALLOC_ENABLE=1`` (every allocation of 2 MiB or more), this advises only buffers the fused path allocates and
fills itself. ``MOETRAIN_HUGEPAGES=0`` turns it off.

The advice changes nothing but the page size, and belongs to the address range, not the tensor: on ``malloc``'s heap
later, unrelated allocations at those addresses would get huge pages too. So a buffer freed after one call is
advised only from :data:`OWN_MAPPING_BYTES` up (glibc always gives it a mapping of its own, unmapped with it); buffers
kept for the life of the process (moe/kernels/cpu/workspace.py) at any size.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64 / arm64 (4 KiB base pages) transparent huge page size
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, malloc/malloc.c): a block this big always gets
# a mapping of its own, unmapped on free.
OWN_MAPPING_BYTES = 32 << 20

_madvise: Callable[[int, int, int], int] | None = None
if sys.platform.startswith("linux"):
    try:
        _libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
        _libc_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc_madvise.restype = ctypes.c_int
        _madvise = _libc_madvise
    except (OSError, AttributeError):  # no libc symbol (static or unusual builds): no advice, same results
        _madvise = None


def enabled() -> bool:
    """Whether advice is given: on Linux, unless ``MOETRAIN_HUGEPAGES`` is ``0`` / ``off`` / ``false`` / ``no``."""
    return _madvise is not None and os.environ.get("MOETRAIN_HUGEPAGES", "1").strip().lower() not in (
        "0", "off", "false", "no")


def advise(tensor: torch.Tensor, *, kept: bool = False) -> torch.Tensor:
    """Ask the kernel to back ``tensor``'s storage with 2 MiB pages; returns ``tensor`` (for chaining).

    Call it on a freshly allocated tensor, before anything writes it. Only whole 2 MiB-aligned pages inside the
    storage are advised. Left alone: a storage under :data:`OWN_MAPPING_BYTES` unless ``kept`` (see the module
    docstring), non-CPU tensors, tensor subclasses (fake tensors), non-strided layouts, tensors without a storage of
    their own (functorch wrappers), and everything off Linux or with ``MOETRAIN_HUGEPAGES=0``. A refused advice (THP
    compiled out) is ignored: the pages stay 4 KiB, the results the same.

    Args:
        tensor: any tensor; its whole storage is advised, not just the view.
        kept: the storage lives until the process ends (or long enough that addresses are not recycled soon).
    Returns:
        ``tensor`` itself.
    """
    # Tensor subclasses (fake tensors while tracing, wrappers) may have no real memory behind their storage.
    if (type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu"
            or tensor.layout != torch.strided):
        return tensor
    try:
        storage = tensor.untyped_storage()
    except NotImplementedError:  # no storage of its own (functorch's grad / vmap wrappers)
        return tensor
    start, nbytes = storage.data_ptr(), storage.nbytes()
    if (nbytes < OWN_MAPPING_BYTES and not kept) or not enabled():  # the size first: no environment read per call
        return tensor
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (start + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if start and end > first and _madvise is not None:  # not None: enabled() said so
        _madvise(first, end - first, _MADV_HUGEPAGE)
    return tensor
