"""Tokens per expert and the arithmetic intensity of the expert GEMMs (the lever BTA pulls).

Legend: T = tokens, D = hidden, E = experts, K = top-k, F = expert FFN hidden, m = rows one expert computes.

An expert computes ``m = T * K / E`` rows (balanced routing). Its forward moves its weights (``mats * D * F``
elements) once whatever m is, plus the activations (``m * (2 D + mats * F)``: input and output of the up / gate
GEMM and of the down GEMM), and does ``2 * m * D * F * mats`` FLOPs; so for m << D, F the intensity is about
``m / weight_bytes`` FLOPs per byte. Below the device's ridge point (peak FLOP/s / memory bandwidth) the GEMMs are
memory-bound: starved. Raising m means raising the tokens the MoE layer sees at once: a larger micro-batch, which
BTA allows without the attention activations of that batch. (Roofline model: Williams, Waterman and Patterson,
"Roofline", CACM 2009.)
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.analysis.shape import ModelShape


def tokens_per_expert(shape: ModelShape, tokens: int, ep: int = 1) -> float:
    """Mean rows per expert for ``tokens`` tokens on each of the ``ep`` ranks of an expert-parallel group (each
    expert receives its assignments from all of them)."""
    return shape.expert_rows(tokens * ep) / shape.num_experts


@dataclass(frozen=True)
class Intensity:
    """One expert's forward: FLOPs, bytes moved, and FLOPs per byte."""

    rows: float
    flops: float
    weight_bytes: float
    act_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.act_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


def expert_intensity(shape: ModelShape, rows: float, act_bytes: int = 2, weight_bytes: int = 2) -> Intensity:
    """Arithmetic intensity of one expert's forward GEMMs for ``rows`` tokens (``act_bytes`` / ``weight_bytes``
    per element: 2 for bf16, 4 for fp32). The backward's two GEMMs per matrix have the same ratio."""
    d, f, mats = shape.hidden, shape.expert_ffn, shape.expert_mats
    return Intensity(rows=rows, flops=2 * rows * shape.expert_params, weight_bytes=shape.expert_params * weight_bytes,
                     act_bytes=rows * (2 * d + mats * f) * act_bytes)
