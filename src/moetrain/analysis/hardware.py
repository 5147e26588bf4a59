"""Device descriptions for the cost model: sourced peak figures, user files, and a measured CPU.

Every preset value carries its source. Peaks are vendor peaks (dense, no structured sparsity); the step-time model
multiplies them by ``efficiency`` (a stated assumption, not a vendor figure) because no real kernel reaches them.
Bandwidths are per device and per direction (a link quoted as "900 GB/s bidirectional" is 450 GB/s each way).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from moetrain.errors import ConfigError

GB = 1e9
GIB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator (or a CPU) as the cost model sees it.

    Fields:
        name: preset or file name.
        peak_flops: dense peak FLOP/s of the training compute dtype (bf16 on accelerators, fp32 on the CPU).
        mem_bytes: device memory in bytes.
        mem_bw: device memory bandwidth, bytes/s.
        intra_bw: per-device, per-direction bandwidth to devices of the same node (NVLink, NeuronLink), bytes/s.
        inter_bw: per-device, per-direction bandwidth to other nodes (InfiniBand / EFA share), bytes/s.
        devices_per_node: devices joined by ``intra_bw``.
        efficiency: fraction of ``peak_flops`` and of the bandwidths that real kernels reach (an assumption).
        sources: field name -> where its value comes from.
    """

    name: str
    peak_flops: float
    mem_bytes: float
    mem_bw: float
    intra_bw: float
    inter_bw: float
    devices_per_node: int = 8
    efficiency: float = 0.5
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bytes", "mem_bw", "intra_bw", "inter_bw"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"hardware {self.name}: {name} must be > 0, got {getattr(self, name)}")
        if self.devices_per_node < 1:
            raise ConfigError(f"hardware {self.name}: devices_per_node must be >= 1, got {self.devices_per_node}")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"hardware {self.name}: efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def ridge(self) -> float:
        """FLOPs per byte where a kernel turns from memory-bound to compute-bound (roofline ridge point)."""
        return self.peak_flops / self.mem_bw


_EFFICIENCY_NOTE = "assumption: typical sustained fraction of peak for large training GEMMs, not a vendor figure"


def _hopper_sxm(gpu: str, mem_gb: int, hbm: str, mem_bw: float, mem_bw_text: str) -> Hardware:
    """An NVIDIA Hopper SXM GPU (H100, H200): the same Tensor Cores, NVLink and DGX networking, its own memory."""
    sheet = f"NVIDIA {gpu} datasheet"
    return Hardware(
        name=gpu.lower(), peak_flops=989.4 * TFLOPS, mem_bytes=mem_gb * GB, mem_bw=mem_bw, intra_bw=450 * GB,
        inter_bw=50 * GB, devices_per_node=8, efficiency=0.5,
        sources={
            "peak_flops": f"NVIDIA {gpu} Tensor Core GPU datasheet, {gpu} SXM: BF16 Tensor Core 1,979 TFLOPS with "
                          "sparsity = 989.4 dense",
            "mem_bytes": f"{sheet}, {gpu} SXM: {mem_gb} GB {hbm}",
            "mem_bw": f"{sheet}, {gpu} SXM: {mem_bw_text}",
            "intra_bw": f"{sheet}: NVLink 900 GB/s (bidirectional) = 450 GB/s per direction",
            "inter_bw": f"NVIDIA DGX {gpu} datasheet: 8x 400 Gb/s ConnectX-7 (one per GPU) = 50 GB/s per GPU",
            "efficiency": _EFFICIENCY_NOTE,
        },
    )


PRESETS: dict[str, Hardware] = {
    "h100": _hopper_sxm("H100", 80, "HBM3", 3.35e12, "3.35 TB/s"),
    "h200": _hopper_sxm("H200", 141, "HBM3e", 4.8e12, "4.8 TB/s"),
    "trn1": Hardware(
        name="trn1", peak_flops=190 * TFLOPS, mem_bytes=32 * GIB, mem_bw=820 * GIB, intra_bw=384 * GIB,
        inter_bw=800e9 / 8 / 16, devices_per_node=16, efficiency=0.5,
        sources={
            "peak_flops": "AWS Neuron docs, Trainium architecture: 190 FP16/BF16/cFP8/TF32 TFLOPS per chip",
            "mem_bytes": "AWS Neuron docs, Trainium architecture: 32 GiB device memory per chip",
            "mem_bw": "AWS Neuron docs, Trn1/Trn1n architecture: 820 GiB/s device memory bandwidth per chip",
            "intra_bw": "AWS Neuron docs, Trn1/Trn1n architecture: trn1.32xlarge NeuronLink-v2 384 GiB/s/device",
            "inter_bw": "AWS Neuron docs, Trn1/Trn1n architecture: trn1.32xlarge EFA 800 Gbps per 16-chip instance",
            "efficiency": _EFFICIENCY_NOTE,
        },
    ),
}


# A peak whose rounds differ by more than this fraction of the best, or measured while other processes kept at
# least half a core busy, is reported as unreliable: load on a shared machine moves a GEMM peak several-fold.
UNRELIABLE_SPREAD = 0.25
UNRELIABLE_BUSY_CORES = 0.5


@dataclass(frozen=True)
class PeakMeasurement:
    """GEMM peaks measured in several interleaved rounds (:func:`measure_peaks`), and whether they can be trusted.

    Attributes:
        rates: dtype name (``fp32``, ``bf16``) -> FLOP/s of each round (one round = best of a few products).
        busy: the most cores other processes kept busy in the samples taken around the rounds
            (:func:`moetrain.runtime.threads.others_busy_cores`); ``None`` where that cannot be measured.
    """

    rates: dict[str, list[float]]
    busy: float | None

    def best(self, dtype: str) -> float:
        """The highest rate of ``dtype`` (FLOP/s): load only ever slows a GEMM down, so the best round is closest
        to the machine's own peak."""
        return max(self.rates[dtype])

    def spread(self, dtype: str) -> float:
        """``1 - slowest / best`` round of ``dtype``, in [0, 1)."""
        return 1.0 - min(self.rates[dtype]) / max(self.rates[dtype])

    def ratios(self, num: str, den: str) -> list[float]:
        """``num`` / ``den`` per round (each round measures both back to back, so under the same load)."""
        return [a / b for a, b in zip(self.rates[num], self.rates[den], strict=True)]

    def merged(self, other: PeakMeasurement) -> PeakMeasurement:
        """The rounds of both measurements (the same dtypes), the higher ``busy``."""
        busy = [b for b in (self.busy, other.busy) if b is not None]
        return PeakMeasurement({k: [*v, *other.rates[k]] for k, v in self.rates.items()},
                               max(busy) if busy else None)

    def unreliable(self) -> str | None:
        """Why these peaks cannot be trusted (the machine was under load, or the rounds disagree), or ``None``."""
        why = []
        if self.busy is not None and self.busy >= UNRELIABLE_BUSY_CORES:
            why.append(f"other processes kept {self.busy:.1f} cores busy")
        spreads = {k: self.spread(k) for k in self.rates if len(self.rates[k]) > 1}
        worst = max(spreads, key=lambda k: spreads[k], default=None)
        if worst is not None and spreads[worst] > UNRELIABLE_SPREAD:
            why.append(f"the {worst} peak varied by {100 * spreads[worst]:.0f}% between rounds")
        return "; ".join(why) or None


def measure_peaks(dtypes: tuple[str, ...] = ("fp32", "bf16"), rounds: int = 3, size: int = 1024,
                  repeats: int = 3) -> PeakMeasurement:
    """GEMM FLOP/s of each of ``dtypes`` on the CPU in ``rounds`` interleaved rounds, each the best of ``repeats``
    [size, size] @ [size, size] products (:func:`moetrain.runtime.cpu.gemm_peak`, uncached), with the cores other
    processes kept busy sampled before and after.

    Raises:
        ValueError: ``rounds`` < 1 or an unknown dtype name.
    """
    import torch

    from moetrain.runtime.cpu import gemm_peak
    from moetrain.runtime.threads import others_busy_cores

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    unknown = [d for d in dtypes if d not in torch_dtypes]
    if unknown:
        raise ValueError(f"unknown dtype {unknown[0]!r}; choose from {sorted(torch_dtypes)}")
    before = others_busy_cores(0.05)
    rates: dict[str, list[float]] = {d: [] for d in dtypes}
    for _ in range(rounds):
        for d in dtypes:
            rates[d].append(gemm_peak(torch_dtypes[d], "cpu", size, repeats, fresh=True))
    busy = [b for b in (before, others_busy_cores(0.05)) if b is not None]
    return PeakMeasurement(rates, max(busy) if busy else None)


def calibrate_cpu(size: int = 1024, repeats: int = 3) -> Hardware:
    """Measure this machine: fp32 matmul FLOP/s (best of ``repeats`` [size, size] @ [size, size],
    :func:`moetrain.runtime.cpu.gemm_peak`) and copy bandwidth (best of ``repeats`` copies of a 64 MiB tensor,
    read + write counted). Takes about a second.

    Memory is the physical RAM; intra/inter bandwidth (processes on one host) are set to the copy bandwidth, and
    ``efficiency`` to 1 because the peaks are themselves measured.
    """
    import torch

    from moetrain.runtime.cpu import best_seconds, gemm_peak

    flops = gemm_peak(torch.float32, "cpu", size, repeats, fresh=True)
    src = torch.empty(16 * 2**20)  # 64 MiB fp32
    dst = torch.empty_like(src)
    best_copy = best_seconds(lambda: dst.copy_(src), repeats)
    bw = 2 * src.numel() * 4 / best_copy
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    note = f"measured by moetrain.analysis.hardware.calibrate_cpu() on {torch.get_num_threads()} threads"
    return Hardware(
        name="cpu", peak_flops=flops, mem_bytes=float(ram), mem_bw=bw, intra_bw=bw, inter_bw=bw,
        devices_per_node=1, efficiency=1.0,
        sources={
            "peak_flops": f"{note}: fp32 {size}x{size} matmul", "mem_bw": f"{note}: 64 MiB tensor copy",
            "mem_bytes": "os.sysconf physical pages", "intra_bw": "copy bandwidth (processes on one host)",
            "inter_bw": "copy bandwidth (processes on one host)", "efficiency": "1: the peaks are measured",
        },
    )


def load_hardware(path: str | Path) -> Hardware:
    """A user-supplied device from a ``.json`` or ``.toml`` file with the :class:`Hardware` fields (SI units:
    FLOP/s, bytes, bytes/s); ``sources`` is optional, ``name`` defaults to the file stem.

    Raises:
        ConfigError: missing file, unknown suffix, syntax error, unknown or missing fields, bad values.
    """
    from moetrain.configlib import load_file

    p = Path(path)
    data = load_file(p, "--device")
    known = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"--device {p}: unknown hardware fields {unknown}; known: {sorted(known)}")
    data.setdefault("name", p.stem)
    data.setdefault("sources", {k: f"user file {p.name}" for k in data if k != "name"})
    try:
        return Hardware(**data)
    except TypeError as e:
        raise ConfigError(f"--device {p}: {e}") from None


def get_hardware(name: str) -> Hardware:
    """A preset (``h100``, ``h200``, ``trn1``), ``cpu`` (calibrated now), or a path to a hardware file.

    Raises:
        ConfigError: neither a preset nor a readable file.
    """
    if name in PRESETS:
        return PRESETS[name]
    if name == "cpu":
        return calibrate_cpu()
    if name.endswith((".json", ".toml")):
        return load_hardware(name)
    raise ConfigError(f"--device {name}: unknown device; choose one of {sorted([*PRESETS, 'cpu'])} or a .json/.toml file")
