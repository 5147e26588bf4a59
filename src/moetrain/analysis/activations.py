"""Activation memory: the bytes a training forward saves for backward, per block, with and without BTA and
activation checkpointing.

Legend: T = tokens, D = hidden, H / Hkv = query / key-value heads, Hd = head size, q = H * Hd, kv = Hkv * Hd,
E = experts, K = top-k, F = expert FFN hidden, Fd = dense FFN hidden, V = vocabulary.

Element counts per token follow what moetrain's own modules save (checked against
``torch.autograd.graph.saved_tensors_hooks``, :mod:`.saved`, within 10% in fp32):

- input RMSNorm (model/norm.py): its input x and the normed output (``D`` each) and rstd (1);
- attention (fused SDPA, flash or memory-efficient, never the S x S matrix): q, k, v after RoPE, the output and
  the log-sum-exp (``2 q + 2 kv + H``); q/k RMSNorm adds their inputs and ``x * rstd`` (fp32); RoPE keeps [S, Hd]
  cos/sin tables per call. ``attention_kernel="math"`` (unfused, the case the BTA paper addresses) adds the H x S
  attention probabilities per token in fp32 and, under autocast, fp32 copies of q, k, v, without the log-sum-exp;
- post-attention RMSNorm: ``2 D + 1``;
- MoE: per routed row the dispatched input and the gathered output (``2 D``) and the expert FFN internals (SwiGLU:
  gate/up output 2F, SiLU output F, product F; GELU: 2F), per token the router's probabilities and logits
  (2E, fp32) and a few index / weight vectors; a shared expert adds the same FFN internals per token. The
  ``fused`` backend (dropless) keeps only the pre-activation (``I`` = 2F SwiGLU, F GELU, per row) and, under
  autocast, the bf16 copy of its input (``D`` per token); ``recompute_experts`` drops the FFN internals (and the
  fused path's pre-activation). Not modelled: on CPU in bf16 / fp16 the fused path pads each expert's rows
  (moe/fast_moe.py ``pad_groups``: under 1/8 more pre-activation rows, ~1/16 on average); CUDA does not pad;
- dense SwiGLU FFN: ``4 Fd``;
- outside the blocks: the final norm (``2 D + 1``) and the fp32 log-softmax of the logits (V) for the loss, or
  the fused loss's gradients (``D`` per token and the V x D weight gradient).

Under bf16 autocast (``act_bytes=2``) GEMM inputs and outputs take 2 bytes; the residual stream and the norms'
internals, the router and the loss stay fp32; autocast's bf16 copies of the weights are saved too.
In a BTA block the attention's weight copies are made inside the tiles' checkpoints, so they are not kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moetrain.analysis.shape import ModelShape

# Per routed row: the dispatched input copy and the gathered output copy (moe/dispatch.py).
_DISPATCH_COPIES = 2
# Per token of an MoE layer, in 4-byte units: E-sized: the router logits and probabilities (fp32); K-sized: expert
# ids and row orders (int64), gating weights; loss terms.
_ROUTING_PER_EXPERT = 2
_ROUTING_PER_K = 6
_ROUTING_SMALL = 6


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one block saves for backward for one micro-batch.

    Attributes:
        block_input: the block's input [T, D] (saved by the input norm; held by BTA's tile checkpoints instead).
        attention: the input norm's other tensors and the attention's, without the block input.
        ffn: post-attention norm and FFN / MoE layer.
    """

    block_input: float
    attention: float
    ffn: float

    @property
    def total(self) -> float:
        return self.block_input + self.attention + self.ffn


def block_activations(
    shape: ModelShape,
    batch: int,
    seq: int,
    moe: bool = True,
    act_bytes: int = 4,
    attention_kernel: Literal["fused", "math"] = "fused",
) -> BlockActivations:
    """Saved-for-backward bytes of one untiled block for ``batch`` sequences of ``seq`` tokens.

    Args:
        moe: an MoE block (else a dense SwiGLU FFN block).
        act_bytes: bytes per element of the GEMM inputs and outputs (4 fp32; 2 under bf16 autocast: see the module
            docstring; the weights' copies are :func:`weight_copy_bytes`).
        attention_kernel: ``fused`` (flash / memory-efficient SDPA) or ``math`` (materialises H x S x S).
    """
    t = batch * seq
    ab, fp = act_bytes, 4
    d, q, kv, h = shape.hidden, shape.q_width, shape.kv_width, shape.n_heads
    # Autocast casts the fp32 normed input once per consuming GEMM (q, k, v; gate, up); fp32 shares one tensor.
    autocast = ab < fp
    attn = fp + d * ab * (3 if autocast else 1) + (2 * q + 2 * kv) * ab + h * fp  # norm; q k v out; lse
    # q/k RMSNorm keeps its input and x * rstd in fp32 (a bf16 input is upcast first) and rstd per head.
    if shape.qk_norm == "head":
        attn += (2 * q + 2 * kv + h + shape.n_kv_heads) * fp
    elif shape.qk_norm == "full":
        attn += (2 * q + 2 * kv + 2) * fp
    if attention_kernel == "math":
        # The unfused kernel keeps the H x S probabilities in fp32, and under autocast fp32 copies of q, k, v
        # (it upcasts them), instead of the fused kernel's log-sum-exp.
        attn += h * seq * fp + (q + 2 * kv) * (fp - ab) - h * fp
    attention = t * attn + 2 * seq * shape.head_size * fp  # + the RoPE cos/sin tables
    if moe:
        internals = 4 if shape.expert_mats == 3 else 2
        rows = shape.expert_rows(t)
        # The router reads the normed input in fp32, so the post-attention norm's output stays fp32.
        ffn = t * (2 * d + 1) * fp
        if shape.fused_experts:  # moe/fast_moe.py saves the pre-activation h [rows, I] unless it recomputes it
            width = (2 if shape.expert_mats == 3 else 1) * shape.expert_ffn
            ffn += (0 if shape.recompute_experts else rows * width * ab) + (t * d * ab if autocast else 0)
        else:  # the recomputed experts (under a checkpoint) save nothing of their own
            ffn += rows * (_DISPATCH_COPIES * d + (0 if shape.recompute_experts else internals * shape.expert_ffn)) * ab
        ffn += t * (_ROUTING_PER_EXPERT * shape.num_experts + _ROUTING_PER_K * shape.top_k + _ROUTING_SMALL) * fp
        if shape.shared_ffn:
            ffn += t * internals * shape.shared_ffn * ab
            if autocast:  # each of the shared expert's input GEMMs (and its gate) casts the input
                ffn += t * (shape.expert_mats - 1 + shape.shared_gate) * d * ab
            if shape.shared_gate:  # sigmoid(gate) * shared: the shared output and the gate's logit / sigmoid
                ffn += t * (d * ab + 2 * fp)
    else:
        ffn = t * ((d + 1) * fp + d * ab * (2 if autocast else 1) + 4 * shape.dense_ffn * ab)
    return BlockActivations(block_input=t * d * fp, attention=attention, ffn=ffn)


def weight_copy_bytes(
    shape: ModelShape, part: Literal["attention", "moe", "dense", "lm_head"], act_bytes: int = 4, ep: int = 1
) -> float:
    """Bytes of autocast's compute-dtype copies of one block part's GEMM weights (or of the LM head), saved for
    backward under autocast (``act_bytes`` < 4); 0 in fp32, where the saved weights are the parameters themselves.
    The router stays fp32 (no copy)."""
    if act_bytes >= 4:
        return 0.0
    d = shape.hidden
    n = {
        "attention": 2 * d * shape.q_width + 2 * d * shape.kv_width,
        # under expert parallelism a rank casts only its E / ep experts
        "moe": shape.num_experts / ep * shape.expert_params + shape.expert_mats * d * shape.shared_ffn,
        "dense": 3 * d * shape.dense_ffn,
        "lm_head": shape.vocab * d,
    }[part]
    return n * act_bytes


@dataclass(frozen=True)
class ActivationMemory:
    """Saved-for-backward bytes of a whole forward (one micro-batch).

    Attributes:
        blocks: per block, what stays saved until backward reaches it.
        other: outside the blocks (final norm, loss).
        transient: what one recomputed region holds during backward (one BTA tile's attention, or one
            checkpointed block); only one such region is alive at a time, so it counts once.
    """

    blocks: list[float] = field(default_factory=list)
    other: float = 0.0
    transient: float = 0.0

    @property
    def peak(self) -> float:
        return sum(self.blocks) + self.other + self.transient


def model_activations(
    shape: ModelShape,
    moe_layer_flags: list[bool],
    batch: int,
    seq: int,
    bta_tiles: int = 1,
    checkpoint: bool = False,
    act_bytes: int = 4,
    attention_kernel: Literal["fused", "math"] = "fused",
    lm_head: bool = True,
    fused_loss: bool = False,
    ep: int = 1,
) -> ActivationMemory:
    """Activation memory of the blocks flagged in ``moe_layer_flags`` (True = MoE block; pass a pipeline stage's
    slice for one stage) plus, with ``lm_head``, the final norm and loss: the logits path (fp32 log-softmax, V per
    token) or, with ``fused_loss`` (how the trainer calls the model: model/fused_ce.py), the loss's gradients
    computed in forward (d_hidden in the compute dtype, D per token, and an fp32 d_weight, V x D once). ``ep``:
    expert-parallel degree (a rank casts only its E / ep experts' weights under autocast).

    BTA (``bta_tiles`` = G > 1): a block keeps its input and its FFN / MoE tensors; one tile's attention
    (``batch / G`` sequences) is alive while it is recomputed. Full activation checkpointing: a block keeps only
    its input; one block's whole activations (with G tiles, its attention for one tile) are alive during its
    recomputation.
    """
    t = batch * seq
    tile_batch = batch // bta_tiles if bta_tiles > 1 else batch
    blocks, transient = [], 0.0
    for is_moe in moe_layer_flags:
        full = block_activations(shape, batch, seq, is_moe, act_bytes, attention_kernel)
        tile = block_activations(shape, tile_batch, seq, is_moe, act_bytes, attention_kernel)
        attn_copy = weight_copy_bytes(shape, "attention", act_bytes)
        ffn_copy = weight_copy_bytes(shape, "moe" if is_moe else "dense", act_bytes, ep)
        if checkpoint:
            blocks.append(full.block_input)
            transient = max(transient, full.ffn + ffn_copy + tile.attention + attn_copy)
        elif bta_tiles > 1:  # the attention's weight copies are made inside the tiles' checkpoints
            blocks.append(full.block_input + full.ffn + ffn_copy)
            transient = max(transient, tile.attention + attn_copy)
        else:
            blocks.append(full.total + attn_copy + ffn_copy)
    other = 0.0
    d = shape.hidden
    if lm_head and fused_loss:  # final norm (fp32 internals), d_hidden, d_weight
        other = t * ((d + 1) * 4 + d * act_bytes) + shape.vocab * d * 4
    elif lm_head:  # final norm (fp32 internals), the LM head's input, the fp32 log-softmax for the loss
        other = t * ((d + 1) * 4 + d * act_bytes + shape.vocab * 4)
        other += weight_copy_bytes(shape, "lm_head", act_bytes)
    return ActivationMemory(blocks=blocks, other=other, transient=transient)
