"""Configuration of one MoE layer: router, capacity, experts, shared expert and balancing losses.

Sources of the conventions: Switch Transformer (Fedus et al., 2021, eq. 4-6) for the load-balancing loss and the
capacity factor; ST-MoE (Zoph et al., 2022, eq. 5) for the router z-loss; Mixtral / Qwen3-MoE (transformers) for
softmax top-k routing with optional renormalisation; DeepSeek-V3 (DeepSeek-AI, 2024, sec. 2.1.2) for sigmoid
scores, group-limited routing, the aux-loss-free expert bias and the sequence-level aux loss; Qwen2-MoE for the
sigmoid-gated shared expert; Megatron-Core (``moe_utils``) for capacity, drop policies and padding to capacity;
MegaBlocks (Gale et al., 2022) for dropless grouped-GEMM experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.configlib import require


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer.

    Fields (experts):
        num_experts: routed experts E.
        top_k: experts per token K (1 <= K <= E).
        expert_ffn_hidden: hidden width F of each routed expert.
        expert_activation: ``swiglu`` (``down(silu(gate x) * up x)``, weights ``gate_up_proj`` [E, 2F, D] and
            ``down_proj`` [E, D, F]) or ``gelu`` (the classic two-matrix FFN ``down(gelu(up x))``, exact erf GELU,
            no biases; weights ``up_proj`` [E, F, D] and ``down_proj`` [E, D, F]).
        backend: ``fused`` (default: hand-written backward; dropless on one device, dispatch + experts + combine
            run as one autograd Function that saves only the pre-activation; per-expert GEMMs on CPU, grouped_mm
            on CUDA bf16; moe/fast_moe.py, moe/fast_experts.py), ``grouped_mm`` (autograd around one grouped GEMM
            per projection, no host sync), ``padded`` (capacity buffers [E, C, D] and batched matmuls; dropless it
            sizes C to the busiest expert, one host sync) or ``loop`` (plain per-expert loop, the reference).
        recompute_experts: keep none of the routed experts' intermediate activations for backward; backward
            recomputes them (Megatron-Core's ``--recompute-modules moe`` for the experts). The fused backend reruns
            the input projection block by block in its backward (for SwiGLU 2 of the expert's 3 weight matrices'
            forward FLOPs, i.e. +2/9 of its forward + backward; saves the [T * K, I] pre-activation), the others
            run the experts under ``torch.utils.checkpoint`` (their [T * K, D] dispatched rows stay saved).
            Outputs and gradients are unchanged.
        shared_expert_ffn_hidden: width of an always-on dense shared expert with the same activation (Qwen2-MoE's
            ``shared_expert_intermediate_size``; DeepSeek's ``n_shared_experts * moe_intermediate_size``); 0 = none.
        shared_expert_gate: scale the shared expert's output by ``sigmoid(x @ w)``, ``w`` [1, D] (Qwen2-MoE).

    Fields (router):
        score_func: ``softmax`` over all experts (Mixtral, Qwen) or per-expert ``sigmoid`` (DeepSeek-V3).
        norm_topk_prob: renormalise the K selected scores to sum to 1 (Mixtral: always; Qwen3-MoE and
            DeepSeek-V3: a flag; Megatron's ``moe_router_pre_softmax=False`` is the softmax case with True).
        routed_scaling_factor: multiply the gating weights by this after renormalisation (DeepSeek-V3: 2.5).
        num_groups: split the experts into this many equal groups for group-limited routing (1 = no groups).
        topk_groups: groups eligible per token (a group is scored by the sum of its two best expert scores);
            ``None`` = all groups.
        expert_bias: keep a per-expert bias (buffer ``router.e_score_correction_bias``, saved in the state dict)
            that is added to the scores for the top-k *selection only* (DeepSeek-V3's aux-loss-free balancing).
        expert_bias_update_rate: after each optimizer step ``bias += rate * sign(mean_count - count)`` with the
            counts of the whole step (all micro-batches, all data-parallel ranks); 0 freezes the bias.
        router_jitter: multiply the router input by noise ~ U(1 - eps, 1 + eps) in training (Switch sec. 2.4;
            Megatron ``moe_input_jitter_eps``); 0 = off.

    Fields (capacity; dropless when ``capacity_factor`` is None):
        capacity_factor: expert capacity ``C = ceil(T * K / E * factor)`` (T = tokens of the micro-batch,
            padding included so that C is static), at least ``min_capacity``, at most T.
        eval_capacity_factor: the factor used in eval mode; ``None`` = same as ``capacity_factor``.
        min_capacity: lower bound of C; ``None`` = no bound.
        drop_policy: which assignments an over-full expert keeps: the highest gating weights (``probs``) or the
            earliest tokens (``position``); ties go to the earlier token.
        pad_to_capacity: every expert processes exactly C rows (empty slots are zero rows), so shapes are static.

    Fields (balancing losses; every coefficient is a weight in the training loss, 0 turns the term off):
        aux_loss_coeff: Switch load-balancing loss per layer, averaged over layers (balanced routing = 1.0).
        pooled_aux_loss_coeff: the same statistics pooled over layers, scaled like transformers'
            ``load_balancing_loss_func`` (balanced routing = K); for parity with Hugging Face models.
        seq_aux_loss_coeff: sequence-level balance loss (DeepSeek-V2/V3), averaged over sequences and layers.
        global_aux_loss_coeff: Switch loss with the counts of the whole optimizer step (all micro-batches, all
            data-parallel ranks; Qiu et al., 2025, "global-batch load balancing").
        z_loss_coeff: router z-loss (mean squared logsumexp of the router logits).
        util_loss_coeff: expert-utilisation regulariser, the standard deviation over experts of the mean routing
            probability.
    """

    num_experts: int = 8
    top_k: int = 2
    expert_ffn_hidden: int = 512
    expert_activation: Literal["swiglu", "gelu"] = "swiglu"
    backend: Literal["fused", "grouped_mm", "padded", "loop"] = "fused"
    recompute_experts: bool = False
    shared_expert_ffn_hidden: int = 0
    shared_expert_gate: bool = False

    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int | None = None
    expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    router_jitter: float = 0.0

    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    min_capacity: int | None = None
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False

    aux_loss_coeff: float = 0.01
    pooled_aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    global_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.001
    util_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        e, k = self.num_experts, self.top_k
        require(e >= 1, "num_experts", f"must be >= 1, got {e}")
        require(k >= 1, "top_k", f"must be >= 1, got {k}")
        require(k <= e, "top_k", f"top-k ({k}) cannot be larger than the number of experts ({e})")
        require(self.expert_ffn_hidden >= 1, "expert_ffn_hidden", f"must be >= 1, got {self.expert_ffn_hidden}")
        require(self.shared_expert_ffn_hidden >= 0, "shared_expert_ffn_hidden",
                f"must be >= 0 (0 = no shared expert), got {self.shared_expert_ffn_hidden}")
        require(not self.shared_expert_gate or self.shared_expert_ffn_hidden > 0, "shared_expert_gate",
                "needs a shared expert; set shared_expert_ffn_hidden > 0")
        require(self.routed_scaling_factor > 0, "routed_scaling_factor",
                f"must be > 0, got {self.routed_scaling_factor}")
        require(self.num_groups >= 1, "num_groups", f"must be >= 1, got {self.num_groups}")
        require(e % self.num_groups == 0, "num_groups",
                f"{self.num_groups} groups do not divide num_experts={e} (groups must be equal)")
        if self.topk_groups is not None:
            require(1 <= self.topk_groups <= self.num_groups, "topk_groups",
                    f"must be in [1, num_groups={self.num_groups}], got {self.topk_groups}")
        eligible = self.groups_per_token * (e // self.num_groups)
        require(k <= eligible, "top_k", f"top-k ({k}) exceeds the {eligible} experts of the "
                f"topk_groups={self.groups_per_token} eligible groups")
        require(self.expert_bias_update_rate >= 0, "expert_bias_update_rate",
                f"must be >= 0, got {self.expert_bias_update_rate}")
        require(0 <= self.router_jitter < 1, "router_jitter", f"must be in [0, 1), got {self.router_jitter}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            require(value is None or value > 0, name, f"must be > 0 (or none for dropless), got {value}")
        require(self.eval_capacity_factor is None or self.capacity_factor is not None, "eval_capacity_factor",
                "needs capacity_factor (a dropless layer has no capacity)")
        require(self.min_capacity is None or self.min_capacity >= 1, "min_capacity",
                f"must be >= 1 (or none), got {self.min_capacity}")
        require(not self.pad_to_capacity or self.capacity_factor is not None, "pad_to_capacity",
                "needs capacity_factor (a dropless layer has no capacity to pad to)")
        for name in ("aux_loss_coeff", "pooled_aux_loss_coeff", "seq_aux_loss_coeff", "global_aux_loss_coeff",
                     "z_loss_coeff", "util_loss_coeff"):
            value = getattr(self, name)
            require(value >= 0, name, f"must be >= 0, got {value}")

    @property
    def groups_per_token(self) -> int:
        """Eligible groups per token (``topk_groups``, or all ``num_groups``)."""
        return self.num_groups if self.topk_groups is None else self.topk_groups

    def capacity_factor_for(self, training: bool) -> float | None:
        """The capacity factor in force (``eval_capacity_factor`` in eval mode when set); ``None`` = dropless."""
        if not training and self.eval_capacity_factor is not None:
            return self.eval_capacity_factor
        return self.capacity_factor
