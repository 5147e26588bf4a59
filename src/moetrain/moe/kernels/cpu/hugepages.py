"""Transparent huge pages for the fused MoE path's large CPU buffers (Linux ``madvise(MADV_HUGEPAGE)``).

Why: PyTorch's CPU allocator is glibc's ``malloc``, which maps every block above 32 MiB (and most above 128 KiB)
afresh and unmaps it on free (see moe/kernels/cpu/workspace.py). A fresh buffer is then faulted in 4 KiB at a time on
first touch, and every later pass over it walks 512x more page-table entries than with 2 MiB pages. Most Linux systems
ship transparent huge pages in ``madvise`` mode (``/sys/kernel/mm/transparent_hugepage/enabled``): a region gets
2 MiB pages only if the program asks. Asking for the fused layer's own buffers (the saved pre-activation, the
expert weight gradients, the combine's output: those of 32 MiB or more, see below; and the kept scratch) measured on a 2-core Sapphire Rapids VM, fp32,
E = 64, K = 8, D = 512, F = 256, T = 4096, forward + backward: 429-469 ms against 479-518 ms without, three
alternating process pairs. The same fault cost measured alone: a copy into a fresh 64 MiB tensor took 36 ms with
4 KiB pages, 22 ms with huge pages, 13 ms into a reused one.

Same mechanism as PyTorch's own opt-in ``THP_MEM_ALLOC_ENABLE=1`` (c10/core/alloc_cpu.cpp: ``madvise`` on every
CPU allocation of 2 MiB or more, read once at start-up, so it must be set before ``import torch``); this module
does it only for buffers the fused path allocates and fills itself, whatever the environment.
``MOETRAIN_HUGEPAGES=0`` turns it off.

The advice changes nothing but the page size: values, shapes and the memory a tensor owns are the same. Pages
already touched are not moved (the kernel may merge them later); so advise a buffer right after allocating it.
The advice belongs to the address range, not to the tensor: on ``malloc``'s heap (glibc raises its mmap threshold
up to 32 MiB after freeing a large block) later, unrelated allocations at those addresses would get huge pages too,
unasked. So a buffer that is freed after one call is advised only from :data:`OWN_MAPPING_BYTES` up, where glibc
always gives it a mapping of its own and the advice is unmapped with it; buffers kept for the life of the process
(moe/kernels/cpu/workspace.py) are advised at any size.
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

    Call it on a freshly allocated tensor, before anything writes it. Only the whole 2 MiB-aligned pages inside the
    storage are advised (never memory outside it). Left alone: a storage under :data:`OWN_MAPPING_BYTES` unless
    ``kept`` (see the module docstring), a storage that holds no such page (any under 2 MiB), non-CPU tensors, tensor subclasses (fake tensors), non-strided layouts (sparse, mkldnn) and tensors
    without a storage of their own (functorch's grad / vmap wrappers) are left alone, as is everything off Linux or
    with ``MOETRAIN_HUGEPAGES=0``. A refused advice (THP compiled out: ``EINVAL``) is ignored: the pages stay 4 KiB
    and the results are the same.

    Args:
        tensor: any tensor; its whole storage is advised, not just the view.
        kept: the storage lives until the process ends (or long enough that addresses are not recycled soon).
    Returns:
        ``tensor`` itself.
    """
    # Tensor subclasses (fake tensors while tracing, wrappers) may have no real memory behind their storage.
    if (type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu"
            or tensor.layout != torch.strided or not enabled()):
        return tensor
    try:
        storage = tensor.untyped_storage()
    except NotImplementedError:  # no storage of its own (functorch's grad / vmap wrappers)
        return tensor
    start, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes < OWN_MAPPING_BYTES and not kept:
        return tensor
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (start + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if start and end > first and _madvise is not None:  # not None: enabled() said so
        _madvise(first, end - first, _MADV_HUGEPAGE)
    return tensor
