"""Communication bytes and times per device for one training step: expert-parallel all-to-all, data-parallel
gradient all-reduce, and pipeline point-to-point.

Legend: T = tokens per device per micro-batch, D = hidden, K = top-k, ep / dp / pp = parallel degrees.

All-to-all (dispatch and combine, forward and backward): each device sends its T * K assignments' hidden vectors
except those for its own experts, a fraction (ep - 1) / ep under balanced routing, four times per MoE layer
(GShard, Lepikhin et al., 2020; Megatron-Core's ``MoEAlltoAllTokenDispatcher``). Ring all-reduce moves
2 (n - 1) / n of the gradient bytes per device (Patarasuk and Yuan, 2009). A pipeline boundary sends the [T, D]
activations forward and their gradient back, per micro-batch.
"""

from __future__ import annotations

from moetrain.analysis.hardware import Hardware
from moetrain.analysis.shape import ModelShape


def all_to_all_bytes(shape: ModelShape, tokens: int, ep: int, moe_layers: int, act_bytes: int = 2) -> float:
    """Bytes one device sends in the all-to-alls of ``moe_layers`` MoE layers for ``tokens`` tokens, forward and
    backward (4 exchanges per layer)."""
    if ep <= 1:
        return 0.0
    rows = shape.expert_rows(tokens)
    return 4 * moe_layers * rows * shape.hidden * act_bytes * (ep - 1) / ep


def all_reduce_bytes(params: float, replicas: int, grad_bytes: int = 4) -> float:
    """Bytes one device sends to all-reduce the gradients of ``params`` parameters across ``replicas`` devices."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * params * grad_bytes


def pipeline_bytes(tokens: int, hidden: int, pp: int, act_bytes: int = 2) -> float:
    """Bytes one interior pipeline stage sends per micro-batch (activations forward, gradients back)."""
    return 0.0 if pp <= 1 else 2 * tokens * hidden * act_bytes


def group_bandwidth(hw: Hardware, group: int, stride: int = 1) -> float:
    """Per-direction bytes/s of a collective over ``group`` devices placed ``stride`` apart: NVLink-class when
    the group fits in one node, else the inter-node share (the slowest link bounds a ring or an all-to-all)."""
    span = (group - 1) * stride + 1
    return hw.intra_bw if span <= hw.devices_per_node else hw.inter_bw


def transfer_time(nbytes: float, bandwidth: float, hw: Hardware) -> float:
    """Seconds to move ``nbytes`` at ``bandwidth`` derated by the device's efficiency."""
    return nbytes / (bandwidth * hw.efficiency) if nbytes else 0.0
