"""Configuration of one MoE layer (router, balancing losses, experts).

Sources of the conventions: Switch Transformer (Fedus et al., 2021, eq. 4-6) for the load-balancing loss,
ST-MoE (Zoph et al., 2022, eq. 5) for the router z-loss, Mixtral / Qwen3-MoE (transformers) for softmax top-k
routing with optional renormalisation, MegaBlocks (Gale et al., 2022) for dropless grouped-GEMM experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.configlib import require


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer.

    Fields:
        num_experts: routed experts E.
        top_k: experts per token K (1 <= K <= E).
        expert_ffn_hidden: hidden width F of each expert's SwiGLU FFN.
        norm_topk_prob: renormalise the top-k probabilities to sum to 1 (Mixtral: always; Qwen3-MoE: a flag).
        aux_loss_coeff: weight of the Switch load-balancing loss (normalised: balanced routing gives 1.0).
        z_loss_coeff: weight of the router z-loss (mean squared logsumexp of the router logits).
        backend: expert computation: ``grouped_mm`` (dropless, one grouped GEMM per projection) or ``loop``
            (plain per-expert loop, the reference).
    """

    num_experts: int = 8
    top_k: int = 2
    expert_ffn_hidden: int = 512
    norm_topk_prob: bool = True
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.001
    backend: Literal["grouped_mm", "loop"] = "grouped_mm"

    def __post_init__(self) -> None:
        require(self.num_experts >= 1, "num_experts", f"must be >= 1, got {self.num_experts}")
        require(self.top_k >= 1, "top_k", f"must be >= 1, got {self.top_k}")
        require(
            self.top_k <= self.num_experts,
            "top_k",
            f"top-k ({self.top_k}) cannot be larger than the number of experts ({self.num_experts})",
        )
        require(self.expert_ffn_hidden >= 1, "expert_ffn_hidden", f"must be >= 1, got {self.expert_ffn_hidden}")
        require(self.aux_loss_coeff >= 0, "aux_loss_coeff", f"must be >= 0, got {self.aux_loss_coeff}")
        require(self.z_loss_coeff >= 0, "z_loss_coeff", f"must be >= 0, got {self.z_loss_coeff}")
