"""Configuration of one MoE layer, one small frozen dataclass per component: router, routed experts, shared expert,
capacity and the auxiliary losses, composed by :class:`MoEConfig` (``model.moe.*``).

Every class here describes the function the layer computes; how it is executed (the expert backend, recomputation)
is :class:`moetrain.execution.ExecutionConfig` (``model.execution.*``), which a resumed run may change.

Each field names the convention it follows: Switch Transformer (Fedus et al., 2021), ST-MoE (Zoph et al., 2022),
Mixtral / Qwen (transformers), DeepSeek-V3 (DeepSeek-AI, 2024), Megatron-Core (``moe_utils``), MegaBlocks (Gale et
al., 2022).

Each class validates its own fields when built; :class:`MoEConfig` checks the combinations across components. An
error names the field path relative to the class (``capacity.factor: must be > 0 ...``); built through
:func:`moetrain.configlib.from_dict` it carries the full path (``model.moe.capacity.factor: ...``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moetrain.configlib import require, require_at_least


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The router: logits -> scores -> top-k expert ids and gating weights (``model.moe.router.*``).

    Fields:
        score_func: ``softmax`` over all experts (Mixtral, Qwen) or per-expert ``sigmoid`` (DeepSeek-V3).
        norm_topk_prob: renormalise the K selected scores to sum to 1 (Mixtral: always; Qwen3-MoE and
            DeepSeek-V3: a flag; Megatron's ``moe_router_pre_softmax=False`` is the softmax case with True).
        routed_scaling_factor: multiply the gating weights by this after renormalisation (DeepSeek-V3: 2.5).
        num_groups: split the experts into this many equal groups for group-limited routing (1 = no groups;
            DeepSeek-V3's ``n_group``); must divide ``model.moe.num_experts``.
        topk_groups: groups eligible per token (a group is scored by the sum of its two best expert scores;
            DeepSeek-V3's ``topk_group``); ``None`` = all groups.
        expert_bias: keep a per-expert bias (buffer ``router.e_score_correction_bias``, saved in the state dict)
            that is added to the scores for the top-k *selection only* (DeepSeek-V3's aux-loss-free balancing).
        expert_bias_update_rate: after each optimizer step ``bias += rate * sign(mean_count - count)`` with the
            counts of the whole step (all micro-batches, all data-parallel ranks); 0 freezes the bias.
        jitter_eps: multiply the router input by noise ~ U(1 - eps, 1 + eps) in training (Switch sec. 2.4;
            Megatron ``moe_input_jitter_eps``); 0 = off.
    """

    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int | None = None
    expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    jitter_eps: float = 0.0

    def __post_init__(self) -> None:
        require(self.routed_scaling_factor > 0, "routed_scaling_factor",
                f"must be > 0, got {self.routed_scaling_factor}")
        require_at_least(self, 1, "num_groups")
        if self.topk_groups is not None:
            require(1 <= self.topk_groups <= self.num_groups, "topk_groups",
                    f"must be in [1, num_groups={self.num_groups}], got {self.topk_groups}")
        require_at_least(self, 0, "expert_bias_update_rate")
        require(0 <= self.jitter_eps < 1, "jitter_eps", f"must be in [0, 1), got {self.jitter_eps}")

    @property
    def groups_per_token(self) -> int:
        """Eligible groups per token (``topk_groups``, or all ``num_groups``)."""
        return self.num_groups if self.topk_groups is None else self.topk_groups


@dataclass(frozen=True, kw_only=True)
class ExpertsConfig:
    """The routed experts (``model.moe.experts.*``); their number is ``model.moe.num_experts``.

    Fields:
        ffn_hidden: hidden width F of each routed expert (transformers' ``moe_intermediate_size``).
        activation: ``swiglu`` (``down(silu(gate x) * up x)``, weights ``gate_up_proj`` [E, 2F, D] and
            ``down_proj`` [E, D, F]; Mixtral, Qwen, DeepSeek) or ``gelu`` (the classic two-matrix FFN
            ``down(gelu(up x))``, exact erf GELU, no biases; weights ``up_proj`` [E, F, D] and ``down_proj``
            [E, D, F]; Switch, GShard). The shared expert uses the same activation.
        dropout: probability of zeroing an element of the routed experts' combined output [T, D] in training
            (before the shared expert is added; on top of ``model.dropout``, which drops the whole FFN branch).
            Switch Transformer's "expert dropout" (Fedus et al. 2022, section 4.2: 0.4 in the experts, 0.1
            elsewhere, for fine-tuning on small data) drops each expert's hidden units instead; dropping the
            weighted sum keeps the fused expert kernels. 0 = off.
    """

    ffn_hidden: int = 512
    activation: Literal["swiglu", "gelu"] = "swiglu"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        require_at_least(self, 1, "ffn_hidden")
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True, kw_only=True)
class SharedExpertConfig:
    """An always-on dense expert beside the routed ones (``model.moe.shared_expert.*``).

    Fields:
        ffn_hidden: its hidden width (Qwen2-MoE's ``shared_expert_intermediate_size``; DeepSeek's
            ``n_shared_experts * moe_intermediate_size``); 0 = no shared expert. Activation: the routed experts'.
        gate: scale its output by ``sigmoid(x @ w)``, ``w`` [1, D] (Qwen2-MoE's ``shared_expert_gate``).
    """

    ffn_hidden: int = 0
    gate: bool = False

    def __post_init__(self) -> None:
        require_at_least(self, 0, "ffn_hidden", note="0 = no shared expert")
        require(not self.gate or self.ffn_hidden > 0, "gate", "needs a shared expert; set ffn_hidden > 0")


@dataclass(frozen=True, kw_only=True)
class CapacityConfig:
    """Expert capacity and token dropping (``model.moe.capacity.*``); dropless when ``factor`` is None.

    Fields:
        factor: expert capacity ``C = ceil(T * K / E * factor)`` (T = tokens of the micro-batch, padding included
            so that C is static), at least ``min_capacity``, at most T (Switch eq. 3; Megatron
            ``moe_expert_capacity_factor``). ``None`` = dropless (MegaBlocks).
        eval_factor: the factor used in eval mode; ``None`` = same as ``factor`` (DeepSpeed's
            ``eval_capacity_factor``).
        min_capacity: lower bound of C; ``None`` = no bound.
        drop_policy: which assignments an over-full expert keeps: the highest gating weights (``probs``) or the
            earliest tokens (``position``); ties go to the earlier token (Megatron ``moe_token_drop_policy``).
        pad_to_capacity: every expert processes exactly C rows (empty slots are zero rows), so shapes are static
            (Megatron ``moe_pad_expert_input_to_capacity``).
    """

    factor: float | None = None
    eval_factor: float | None = None
    min_capacity: int | None = None
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False

    def __post_init__(self) -> None:
        for name in ("factor", "eval_factor"):
            value = getattr(self, name)
            require(value is None or value > 0, name, f"must be > 0 (or none for dropless), got {value}")
        require(self.eval_factor is None or self.factor is not None, "eval_factor",
                "needs factor (a dropless layer has no capacity)")
        require(self.min_capacity is None or self.min_capacity >= 1, "min_capacity",
                f"must be >= 1 (or none), got {self.min_capacity}")
        require(not self.pad_to_capacity or self.factor is not None, "pad_to_capacity",
                "needs factor (a dropless layer has no capacity to pad to)")

    def factor_for(self, training: bool) -> float | None:
        """The capacity factor in force (``eval_factor`` in eval mode when set); ``None`` = dropless."""
        if not training and self.eval_factor is not None:
            return self.eval_factor
        return self.factor


@dataclass(frozen=True, kw_only=True)
class AuxLossConfig:
    """Coefficients of the auxiliary losses added to the training loss (``model.moe.losses.*``); 0 turns a term off.

    Fields:
        aux_loss_coeff: Switch load-balancing loss per layer (Switch eq. 4-6), averaged over layers (balanced
            routing = 1.0; Megatron ``moe_aux_loss_coeff``).
        pooled_aux_loss_coeff: the same statistics pooled over layers, scaled like transformers'
            ``load_balancing_loss_func`` (balanced routing = K); for parity with Hugging Face models.
        seq_aux_loss_coeff: sequence-level balance loss (DeepSeek-V2/V3), averaged over sequences and layers.
        global_aux_loss_coeff: Switch loss with the counts of the whole optimizer step (all micro-batches, all
            data-parallel ranks; Qiu et al., 2025, "global-batch load balancing").
        z_loss_coeff: router z-loss (ST-MoE eq. 5: mean squared logsumexp of the router logits).
        util_loss_coeff: expert-utilisation regulariser, the standard deviation over experts of the mean routing
            probability.
        entropy_loss_coeff: gate-output smoothing against early loss oscillation: the mean entropy deficit of
            each token's routing distribution, ``(log E - H(p_t)) / log E`` (a confidence penalty on the gate,
            Pereyra et al., 2017; against StableMoE's routing fluctuation; moe/gate_smoothing.py). 0: off.
    """

    aux_loss_coeff: float = 0.01
    pooled_aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    global_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.001
    util_loss_coeff: float = 0.0
    entropy_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        require_at_least(self, 0, "aux_loss_coeff", "pooled_aux_loss_coeff", "seq_aux_loss_coeff",
                         "global_aux_loss_coeff", "z_loss_coeff", "util_loss_coeff", "entropy_loss_coeff")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer (``model.moe.*``): E experts, K of them per token, and its components.

    Fields:
        num_experts: routed experts E.
        top_k: experts per token K (1 <= K <= E, and at most the experts of the eligible groups).
        router: :class:`RouterConfig`.
        experts: :class:`ExpertsConfig`.
        shared_expert: :class:`SharedExpertConfig`.
        capacity: :class:`CapacityConfig` (dropless by default).
        losses: :class:`AuxLossConfig`.
    """

    num_experts: int = 8
    top_k: int = 2
    router: RouterConfig = field(default_factory=RouterConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    shared_expert: SharedExpertConfig = field(default_factory=SharedExpertConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    losses: AuxLossConfig = field(default_factory=AuxLossConfig)

    def __post_init__(self) -> None:
        e, k, r = self.num_experts, self.top_k, self.router
        require_at_least(self, 1, "num_experts", "top_k")
        require(k <= e, "top_k", f"top-k ({k}) cannot be larger than the number of experts ({e})")
        require(e % r.num_groups == 0, "router.num_groups",
                f"{r.num_groups} groups do not divide num_experts={e} (groups must be equal)")
        eligible = r.groups_per_token * (e // r.num_groups)
        require(k <= eligible, "top_k", f"top-k ({k}) exceeds the {eligible} experts of the "
                f"router.topk_groups={r.groups_per_token} eligible groups")
