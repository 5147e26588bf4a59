"""CPU features, calibrated GEMM peaks, and where bf16 compute pays (the bf16 policy): bf16 counts as fast where
``/proc/cpuinfo`` lists ``avx512_bf16`` or ``amx_bf16`` and no kernel-library ISA limit hides them; elsewhere bf16
autocast computes in fp32 (:func:`bf16_compute`). ``MOETRAIN_BF16`` (``auto``, ``bf16``, ``fp32``) forces it. Why,
with the measurements: docs/robustness.md, "bf16 policy".
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass

import torch

BF16_ENV = "MOETRAIN_BF16"

# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) that still include native bf16 GEMMs; any other named limit hides them.
_BF16_ISAS = {"ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
              "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"}


def isa_limit() -> str | None:
    """The environment variable that hides native bf16 from the kernels (``NAME=value``), or ``None``."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).strip().upper()
    if onednn and onednn not in _BF16_ISAS:
        return f"ONEDNN_MAX_CPU_ISA={onednn}"
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in ("default", "avx2"):
        return f"ATEN_CPU_CAPABILITY={aten}"
    return None


def _cpuinfo(key: str) -> str | None:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (``None`` where there is none)."""
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    import platform

    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    return set((_cpuinfo("flags") or "").split())


def bf16_flags() -> list[str]:
    """The native-bf16 features this CPU reports (``avx512_bf16``, ``amx_bf16``), possibly none."""
    return sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def best_seconds(fn, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` in seconds, after one untimed warm-up call (thread pool,
    packing buffers); a CUDA ``device`` is synchronised around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_info() -> dict[str, object]:
    """This CPU as a benchmark or ``moetrain doctor`` records it: ``cpu_model``, ``bf16_flags`` (its native-bf16
    features), ``bf16_fast`` and ``bf16_reason`` (whether bf16 autocast computes in bf16 here, and why)."""
    support = bf16_support("cpu")
    return {"cpu_model": cpu_model(), "bf16_flags": bf16_flags(), "bf16_fast": support.fast,
            "bf16_reason": support.reason}


def _gemm_rate(dtype: torch.dtype, device: torch.device, size: int, repeats: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)  # never the global RNG: a run's random stream stays as is
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b, repeats, device)


@functools.lru_cache(maxsize=None)
def _cached_rate(dtype: torch.dtype, device: str, size: int, repeats: int, threads: int) -> float:
    return _gemm_rate(dtype, torch.device(device), size, repeats)


def gemm_peak(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", size: int = 1024,
              repeats: int = 3, fresh: bool = False) -> float:
    """Calibrated GEMM rate in FLOP/s: best of ``repeats`` [size, size] @ [size, size] products in ``dtype`` on
    ``device`` with the current intra-op threads (cached per process, dtype, device and thread count; ``fresh``
    measures again, uncached). The trainer's MFU and ``moetrain doctor`` use it."""
    device = torch.device(device)
    if fresh:
        return _gemm_rate(dtype, device, size, repeats)
    return _cached_rate(dtype, str(device), size, repeats, torch.get_num_threads())


@dataclass(frozen=True)
class Bf16Support:
    """Whether bf16 GEMMs are fast here, and why.

    Attributes:
        fast: bf16 autocast computes in bf16 (else in fp32, :func:`bf16_compute`).
        flags: the native-bf16 CPU flags present.
        reason: one line for the user.
    """

    fast: bool
    flags: tuple[str, ...]
    reason: str


@functools.lru_cache(maxsize=None)
def bf16_support(device: str = "cpu") -> Bf16Support:
    """Whether bf16 GEMMs are fast on ``device`` (decided once per process from the CPU's features and the
    ``MOETRAIN_BF16`` / ISA-limit environment; see the module doc); CUDA is taken as fast.

    Raises:
        ConfigError: ``MOETRAIN_BF16`` is set to something other than ``auto``, ``bf16``, ``fp32``.
    """
    forced = os.environ.get(BF16_ENV, "auto").strip().lower() or "auto"
    if forced not in ("auto", "bf16", "fp32"):
        from moetrain.errors import ConfigError

        raise ConfigError(f"{BF16_ENV}: must be one of auto, bf16, fp32, got {forced!r}")
    flags = tuple(bf16_flags())
    if torch.device(device).type != "cpu":
        return Bf16Support(forced != "fp32", flags, f"bf16 on {device}")
    if forced != "auto":
        return Bf16Support(forced == "bf16", flags, f"{BF16_ENV}={forced}")
    if not flags:
        return Bf16Support(False, flags, "no avx512_bf16 / amx_bf16: bf16 GEMMs take a slow path (~100x fp32)")
    limit = isa_limit()
    if limit is not None:
        return Bf16Support(False, flags, f"{', '.join(flags)} hidden from the kernels by {limit}")
    return Bf16Support(True, flags, f"native bf16 GEMMs ({', '.join(flags)})")


def bf16_compute(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 autocast should compute in bf16 on ``device`` (False: compute in fp32; see the module doc)."""
    return bf16_support(torch.device(device).type).fast


def bf16_policy_line(dtype: str, device: torch.device | str) -> str | None:
    """The line the trainer prints at start when ``train.dtype=bf16`` (``None`` for fp32)."""
    if dtype != "bf16":
        return None
    s = bf16_support(torch.device(device).type)
    if s.fast:
        return f"train.dtype=bf16: bf16 autocast ({s.reason})"
    return (f"train.dtype=bf16: this CPU has no fast bf16 GEMMs ({s.reason}), so the model computes in fp32 "
            f"(bf16 would be slower here, not faster); set {BF16_ENV}=bf16 to force bf16")


def bf16_autocast_is_slow(device_type: str) -> bool:
    """Whether bf16 autocast is on for ``device_type`` (the caller's ``torch.autocast``) on a CPU where bf16 GEMMs
    are slow: the model then runs its forward (and so its backward) with autocast off, in fp32
    (:meth:`moetrain.model.transformer.MoETransformer.forward`). Its outputs are then fp32, not bf16."""
    return (device_type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16 and not bf16_compute("cpu"))
