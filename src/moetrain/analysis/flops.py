"""FLOPs of one training micro-batch, per model part, forward and backward.

Legend: B = sequences, S = sequence length, T = B * S tokens, D = hidden, H / Hkv = query / key-value heads,
Hd = head size, V = vocabulary, E = experts, K = top-k, F = expert FFN hidden, Fs = shared-expert FFN hidden.

Counted as ``torch.utils.flop_counter.FlopCounterMode`` counts them: 2 * m * n * k per matrix product, nothing for
element-wise work (norms, softmax, SiLU, RoPE, the loss), backward = 2 x forward for every product (input and
weight gradients). Attention scores count the full S x S square (QK^T and PV: 4 * B * H * S^2 * Hd forward), as
PyTorch's counter does; causal kernels skip about half of it. Recomputation is reported apart: BTA recomputes
each block's norm + attention forward in backward up to the attention output (``torch.utils.checkpoint`` stops
early, so o_proj is not rerun); activation checkpointing is costed as a whole block's forward (an upper bound by the
same early stop).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.analysis.shape import ModelShape


@dataclass(frozen=True)
class PartFlops:
    """FLOPs of one model part over the whole model for one micro-batch."""

    forward: float
    backward: float
    recompute: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def forward_flops(shape: ModelShape, batch: int, seq: int) -> dict[str, float]:
    """Forward FLOPs per part (``attn_proj``, ``attn_scores``, ``router``, ``experts``, ``shared_experts``,
    ``dense_ffn``, ``lm_head``) for ``batch`` sequences of ``seq`` tokens, whole model."""
    t = batch * seq
    d, q, kv = shape.hidden, shape.q_width, shape.kv_width
    rows = shape.expert_rows(t)
    return {
        "attn_proj": shape.n_layers * 2 * t * d * (2 * q + 2 * kv),
        "attn_scores": shape.n_layers * 4 * batch * shape.n_heads * seq * seq * shape.head_size,
        "router": shape.moe_layers * 2 * t * d * shape.num_experts,
        "experts": shape.moe_layers * 2 * rows * shape.expert_params,
        "shared_experts": shape.moe_layers * (
            2 * t * d * shape.shared_ffn * shape.expert_mats + (2 * t * d if shape.shared_gate else 0)
        ),
        "dense_ffn": shape.dense_layers * 2 * t * d * shape.dense_ffn * 3,
        "lm_head": 2 * t * d * shape.vocab,
    }


def step_flops(
    shape: ModelShape, batch: int, seq: int, bta_tiles: int = 1, checkpoint: bool = False
) -> dict[str, PartFlops]:
    """Forward, backward and recomputation FLOPs per part for one micro-batch of ``batch`` x ``seq`` tokens.

    Args:
        bta_tiles: G; G > 1 recomputes the attention (projections and scores) forward once in backward.
        checkpoint: full activation checkpointing of every block (recomputes all block parts; not the LM head);
            with BTA as well, the attention is recomputed twice.
    """
    fwd = forward_flops(shape, batch, seq)
    out = {}
    for part, f in fwd.items():
        recompute = 0.0
        if checkpoint and part != "lm_head":
            recompute += f
        if bta_tiles > 1 and part == "attn_scores":
            recompute += f  # inside a checkpointed block too: the block's recompute runs the tiles unsaved
        if bta_tiles > 1 and part == "attn_proj":
            # Non-reentrant checkpoint stops recomputing once every saved tensor is back: o_proj's input is the
            # last one needed, so o_proj itself is not rerun.
            recompute += f * (shape.q_width + 2 * shape.kv_width) / (2 * shape.q_width + 2 * shape.kv_width)
        out[part] = PartFlops(forward=f, backward=2 * f, recompute=recompute)
    return out


def total_flops(parts: dict[str, PartFlops]) -> float:
    """Sum over parts of forward + backward + recomputation."""
    return sum(p.total for p in parts.values())


def model_flops_per_token(shape: ModelShape, seq: int) -> float:
    """Forward + backward FLOPs per token without recomputation (the "6 N" of MFU, with attention)."""
    return total_flops(step_flops(shape, 1, seq)) / seq
