"""The model's dimensions as the cost model needs them, read once from a :class:`ModelConfig`.

Legend: V = vocabulary, D = hidden, L = blocks, H / Hkv = query / key-value heads, Hd = head size, E = experts,
K = top-k, F = expert FFN hidden, Fs = shared-expert FFN hidden, Fd = dense FFN hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetrain.model.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of an MoE transformer.

    Attributes:
        vocab, hidden, n_layers, n_heads, n_kv_heads, head_size, dense_ffn: V, D, L, H, Hkv, Hd, Fd.
        qk_norm: ``none`` | ``head`` | ``full``.
        attention_bias: q/k/v projections have biases (Qwen2).
        tie_embeddings: LM head shares the embedding matrix.
        moe_layers / dense_layers: how many blocks have an MoE / a dense FFN.
        num_experts, top_k, expert_ffn: E, K, F.
        expert_mats: weight matrices per expert (3 for SwiGLU: gate, up, down; 2 for GELU: up, down).
        shared_ffn: Fs (0 = no shared expert); shared_gate: a [1, D] sigmoid gate on it.
        capacity_factor: ``None`` = dropless; else the expert capacity factor.
        pad_to_capacity: every expert computes exactly C rows.
        fused_experts: dispatch, experts and combine run as moe/fast_moe.py's one Function (the ``fused`` backend,
            dropless, on one device: under expert parallelism the layer takes the unfused all-to-all path, which
            analysis/step.py accounts for; what it saves for backward differs from the unfused path's).
        recompute_experts: the experts' intermediates are recomputed in backward
            (``model.execution.recompute_experts``).
    """

    vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_size: int
    dense_ffn: int
    qk_norm: str
    attention_bias: bool
    tie_embeddings: bool
    moe_layers: int
    dense_layers: int
    num_experts: int
    top_k: int
    expert_ffn: int
    expert_mats: int = 3
    shared_ffn: int = 0
    shared_gate: bool = False
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    fused_experts: bool = False
    recompute_experts: bool = False

    @classmethod
    def from_config(cls, config: ModelConfig) -> "ModelShape":
        moe = config.moe
        n_moe = len(config.moe_layer_indices)
        execution = config.execution
        return cls(
            vocab=config.vocab_size, hidden=config.hidden, n_layers=config.n_layers, n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads, head_size=config.head_size, dense_ffn=config.ffn_hidden,
            qk_norm=config.qk_norm, attention_bias=getattr(config, "attention_bias", False),
            tie_embeddings=config.tie_embeddings, moe_layers=n_moe,
            dense_layers=config.n_layers - n_moe, num_experts=moe.num_experts, top_k=moe.top_k,
            expert_ffn=moe.experts.ffn_hidden, expert_mats=3 if moe.experts.activation == "swiglu" else 2,
            shared_ffn=moe.shared_expert.ffn_hidden, shared_gate=moe.shared_expert.gate,
            capacity_factor=moe.capacity.factor, pad_to_capacity=moe.capacity.pad_to_capacity,
            fused_experts=execution.moe_backend == "fused" and moe.capacity.factor is None,
            recompute_experts=execution.recompute_experts,
        )

    @property
    def q_width(self) -> int:
        """H * Hd."""
        return self.n_heads * self.head_size

    @property
    def kv_width(self) -> int:
        """Hkv * Hd."""
        return self.n_kv_heads * self.head_size

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert: expert_mats * D * F (the FLOPs, bytes and parameter counts all use it)."""
        return self.expert_mats * self.hidden * self.expert_ffn

    def expert_rows(self, tokens: int) -> int:
        """Rows the routed experts compute for ``tokens`` tokens: T * K dropless; with a capacity factor at most
        E * C (assuming balanced routing), exactly E * C when padded to capacity."""
        assignments = tokens * self.top_k
        if self.capacity_factor is None:
            return assignments
        capacity = min(tokens, math.ceil(assignments / self.num_experts * self.capacity_factor))
        slots = self.num_experts * capacity
        return slots if self.pad_to_capacity else min(assignments, slots)
