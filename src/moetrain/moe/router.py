"""Top-k router: logits -> scores -> (biased, group-limited) selection -> top-k expert ids and gating weights.

Legend: T = tokens, D = hidden, E = experts, K = top-k, G = expert groups.

Vocabulary (Megatron-Core ``moe/router.py``): *logits* ``x @ W^T``; *scores* the softmax over all experts
(Mixtral, Qwen) or the per-expert sigmoid (DeepSeek-V3); *selection scores* = scores + expert bias, restricted to
the eligible groups, used only to choose the K experts; *gating weights* = the chosen experts' unbiased scores,
optionally renormalised and scaled; *probs* = scores normalised to sum to 1 per token, the input of the balancing
losses (softmax: the scores themselves; sigmoid: ``s / sum(s)``, DeepSeek-V3 eq. 20).

The router runs in fp32 even under bf16 autocast: its logits are small differences between experts (a bf16
mantissa of 8 bits flips near-ties, e.g. logits 1.001 vs 1.003) and the softmax, the top-k choice and the
load-balancing losses are sensitive to them (Switch Transformer, sec. 2.4 "selective precision"). The cost is one
fp32 [T, D] x [D, E] GEMM, negligible next to the experts.

Tie-breaking is deterministic: among equal scores the lowest expert (or group) index wins (a stable descending
sort), so results do not depend on the backend's ``topk`` implementation (CPU ``torch.topk`` returns ties in an
arbitrary order).
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.moe.balancing import expert_bias_delta
from moetrain.moe.config import MoEConfig
from moetrain.moe.weight_init import DEFAULT_STD, initialise_now


@dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens (all fp32, or fp64 for fp64 inputs).

    Attributes:
        logits: [T, E] router logits ``x @ W^T``.
        scores: [T, E] softmax over all experts, or per-expert sigmoid; unbiased.
        probs: [T, E] scores normalised to sum to 1 per token (input of the balancing losses).
        topk_ids: [T, K] int64 chosen experts, best selection score first (ties: lowest index first).
        topk_weights: [T, K] gating weights: the chosen unbiased scores, renormalised and scaled as configured.
    """

    logits: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def topk_stable(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with ties broken by the lowest index.

    K rounds of ``max`` over the last dim (which returns the first of equal maxima), each masking its pick, instead
    of a stable descending sort of all E: the same ids and values, 2-3x faster on CPU (docs/performance.md). ``-inf``
    scores are ranked as the lowest finite value while picking, so that a masked pick
    (``-inf``) ranks below every score not yet picked and no id repeats; the returned values are the input's own.

    Args:
        scores: [..., E] float.
        k: how many to keep (<= E).
    Returns:
        (values [..., K], indices [..., K] int64), best first.
    """
    work = scores.clamp(min=torch.finfo(scores.dtype).min)  # a copy, masked in place below
    picks = []
    for j in range(k):
        _, pick = work.max(dim=-1, keepdim=True)  # [..., 1]: the first of equal maxima (torch.max's documented rule)
        picks.append(pick)
        if j + 1 < k:
            work.scatter_(-1, pick, float("-inf"))
    indices = torch.cat(picks, dim=-1)
    return scores.gather(-1, indices), indices


def softmax_experts(logits: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(logits, dim=-1)`` over the experts, [T, E] -> [T, E], in a layout that is fast for few experts.

    On CPU with E < 16 the softmax runs over dim 0 of the transposed view, copied back to a contiguous [T, E] (the
    router may be an FSDP2 unit of its own, which must not return views): PyTorch's last-dim CPU kernel handles a
    row shorter than one vector register lane by lane (figures: docs/results.md; from E = 16 the last-dim kernel is
    faster). Same maths, rounded within an ulp of the last-dim kernel's.
    """
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[-1] < 16:
        return torch.softmax(logits.t(), dim=0).t().contiguous()
    return torch.softmax(logits, dim=-1)


def group_limited_mask(selection: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Experts of the ``topk_groups`` best groups (DeepSeek-V3 node-limited routing; transformers
    ``DeepseekV3TopkRouter``; Megatron ``group_limited_topk``).

    A group's score is the sum of its two best selection scores (one when a group holds a single expert); the
    best groups win, ties to the lowest group index. Megatron sums the top ``K // topk_groups`` instead, which is 2
    for DeepSeek-V3 (K = 8, 4 groups).

    Args:
        selection: [T, E] selection scores (biased when an expert bias is on).
        num_groups: G, dividing E.
        topk_groups: eligible groups per token.
    Returns:
        [T, E] bool, True for experts of eligible groups.
    """
    t, e = selection.shape
    per_group = e // num_groups
    grouped = selection.reshape(t, num_groups, per_group)
    group_scores = topk_stable(grouped, min(2, per_group))[0].sum(dim=-1)  # [T, G]
    _, best = topk_stable(group_scores, topk_groups)  # [T, topk_groups]
    eligible = torch.zeros(t, num_groups, dtype=torch.bool, device=selection.device).scatter_(1, best, True)
    return eligible.repeat_interleave(per_group, dim=1)  # [T, E]


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    num_groups: int = 1,
    topk_groups: int | None = None,
    expert_bias: torch.Tensor | None = None,
) -> Routing:
    """Scores, selection and gating weights from router logits.

    Matches transformers' ``MixtralTopKRouter`` (softmax, renormalised), ``Qwen3MoeTopKRouter`` /
    ``Qwen2MoeTopKRouter`` (softmax, ``norm_topk_prob``), ``DeepseekV3TopkRouter`` (sigmoid, groups,
    ``e_score_correction_bias``, ``routed_scaling_factor``) and Megatron-Core ``topk_routing_with_score_function``
    (its ``use_pre_softmax=False`` softmax is ours with ``norm_topk_prob=True``; its sigmoid renormalises iff K > 1).

    Args:
        logits: [T, E] router logits (computed in at least fp32 here).
        top_k: K.
        score_func: ``softmax`` or ``sigmoid``.
        norm_topk_prob: divide the K chosen scores by their sum (+1e-20, as DeepSeek-V3 and Megatron).
        routed_scaling_factor: multiply the gating weights by this (after renormalisation).
        num_groups: expert groups of group-limited routing (see :func:`group_limited_mask`); 1 = no groups.
        topk_groups: groups eligible per token; ``None`` or ``== num_groups`` means no limit.
        expert_bias: [E] added to the scores for the selection only; the gating weights stay unbiased (the
            aux-loss-free balancing of Wang et al., 2024, used by DeepSeek-V3).
    Returns:
        :class:`Routing`.
    """
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if score_func == "softmax":
        scores = probs = softmax_experts(logits)
    elif score_func == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"model.moe.router.score_func: unknown score function {score_func!r}; choose softmax or "
                         "sigmoid")
    # The bias and the group mask shape the choice only; nothing below differentiates through `selection`.
    selection = scores.detach() if scores.requires_grad else scores
    if expert_bias is not None:
        selection = selection + expert_bias.to(selection.dtype)
    if topk_groups is not None and topk_groups < num_groups:
        eligible = group_limited_mask(selection, num_groups, topk_groups)
        # -inf never wins: the config guarantees K <= eligible experts per token.
        selection = selection.masked_fill(~eligible, float("-inf"))
    _, topk_ids = topk_stable(selection, top_k)
    weights = scores.gather(1, topk_ids)  # [T, K] unbiased
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return Routing(logits=logits, scores=scores, probs=probs, topk_ids=topk_ids, topk_weights=weights)


class TopKRouter(nn.Module):
    """Linear gate ``weight`` [E, D] (no bias), then :func:`route` with the layer's settings; computed in fp32.

    With ``config.router.expert_bias`` it owns the buffer ``e_score_correction_bias`` [E] fp32 (transformers'
    DeepSeek-V3 name; Megatron's ``expert_bias``), saved in the state dict and changed only by
    :meth:`update_expert_bias`.

    Args:
        hidden: D.
        config: the layer's :class:`MoEConfig`.
    """

    def __init__(self, hidden: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden))
        self.e_score_correction_bias: torch.Tensor | None
        if config.router.expert_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        if initialise_now():  # not inside MoETransformer, which draws every weight itself (moe/weight_init.py)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = DEFAULT_STD) -> None:
        """``weight`` [E, D] ~ Normal(0, std) (``MoETransformer.reset_parameters`` uses the model's ``init_std``)."""
        self.weight.normal_(0.0, std)

    def forward(self, x: torch.Tensor) -> Routing:
        """x: [T, D] any float dtype -> :class:`Routing` (fp32; input jitter only in training mode)."""
        c, r = self.config, self.config.router
        dtype = torch.promote_types(x.dtype, torch.float32)
        # fp32 under autocast too; without autocast and with fp32 operands (decode steps) the context and the
        # no-op casts are skipped: each costs more than the router's GEMM on a few tokens
        with torch.autocast(device_type=x.device.type, enabled=False) if torch.is_autocast_enabled(x.device.type) \
                else contextlib.nullcontext():
            h = x if x.dtype == dtype else x.to(dtype)
            if self.training and r.jitter_eps > 0:
                h = h * torch.empty_like(h).uniform_(1.0 - r.jitter_eps, 1.0 + r.jitter_eps)
            logits = F.linear(h, self.weight if self.weight.dtype == dtype else self.weight.to(dtype))  # [T, E]
        return route(
            logits, c.top_k, score_func=r.score_func, norm_topk_prob=r.norm_topk_prob,
            routed_scaling_factor=r.routed_scaling_factor, num_groups=r.num_groups, topk_groups=r.topk_groups,
            expert_bias=self.e_score_correction_bias,
        )

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """``bias += rate * sign(mean(counts) - counts)`` (see :func:`moetrain.moe.balancing.expert_bias_delta`).

        Args:
            counts: [E] assignments per expert over one whole optimizer step (all micro-batches and ranks).
        Raises:
            RuntimeError: the layer has no expert bias (``config.router.expert_bias`` is off).
        """
        if self.e_score_correction_bias is None:
            raise RuntimeError("update_expert_bias: this router has no expert bias "
                               "(model.moe.router.expert_bias=false)")
        delta = expert_bias_delta(counts, self.config.router.expert_bias_update_rate)
        self.e_score_correction_bias.add_(delta.to(self.e_score_correction_bias))
