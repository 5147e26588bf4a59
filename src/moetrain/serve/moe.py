"""The MoE layer at inference: the step's routing policies as the layer's routing hook.

Legend: T = tokens, D = hidden, E = experts, K = trained top-k, Kmax = the step's largest k.

A variable number of experts per token is expressed as a fixed [T, Kmax] top-k with a ``keep`` mask: the gating
weights of unkept candidates are zero and their assignments are dropped by the dispatcher (they sort after every
expert's rows and are never computed: the experts see ``sum(keep)`` rows). The layer itself
(:meth:`moetrain.moe.layer.MoELayer.forward` with ``routing=``) then runs its own dispatch, experts (or expert
provider) and shared expert. When every token keeps all Kmax candidates (``fixed``, and ``load`` within a step),
``keep`` is ``None`` and the layer runs exactly its training kernel (the fused dispatcher's one Function on one
device); the default policy even calls the layer's own router module, so outputs equal the training forward.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetrain.serve.routing import Int8Router, RoutingPolicy, tokens_k

_NEVER = 2.0  # a probability mass above 1: the threshold rule never stops early


@dataclass(frozen=True)
class StepPolicies:
    """The routing policies of one engine step, in token order.

    Attributes:
        segments: (policy, number of consecutive tokens) pairs covering the step's T tokens.
        depth: the engine's queue depth (waiting + running requests), for the ``load`` policy.
    """

    segments: tuple[tuple[RoutingPolicy, int], ...]
    depth: int = 0

    @functools.cached_property
    def default(self) -> bool:
        """Every segment's policy is the default (asked by every MoE layer of the step)."""
        return all(p.is_default() for p, _ in self.segments)


@dataclass(frozen=True)
class MoEStepStats:
    """Per-layer routing of one step: ``counts`` [E] int64 kept assignments per expert, ``active`` kept
    assignments in all (mean active experts per token = active / T), ``k_used`` [T] int64 experts per token."""

    counts: torch.Tensor
    active: int
    k_used: torch.Tensor


def _token_bounds(layer_cfg, policies: StepPolicies, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T] p, k_min, k_max for one layer from the step's policy segments."""
    k_trained, e = layer_cfg.top_k, layer_cfg.num_experts
    p, lo, hi = torch.empty(t), torch.empty(t, dtype=torch.int64), torch.empty(t, dtype=torch.int64)
    start = 0
    for policy, n in policies.segments:
        kmin, kmax = policy.bounds(k_trained, e)
        mass = _NEVER
        if policy.policy == "load":
            kmin = kmax = policy.load_k(k_trained, e, policies.depth)
        elif policy.policy == "threshold":
            mass = policy.p
        p[start:start + n], lo[start:start + n], hi[start:start + n] = mass, kmin, kmax
        start += n
    return p, lo, hi


def route_with_policy(layer, tokens: torch.Tensor, policies: StepPolicies, int8: Int8Router | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Top-k ids, gating weights and keep mask of T tokens under the step's policies.

    Args:
        layer: a :class:`~moetrain.moe.layer.MoELayer` (its ``router`` weight, bias and settings are read).
        tokens: [T, D].
        policies: the step's :class:`StepPolicies` (segments must cover T tokens).
        int8: use this int8 router instead of the fp32 weight.
    Returns:
        (ids [T, Kmax] int64 best first, weights [T, Kmax] fp32 (zero where not kept), keep [T, Kmax] bool or
        ``None`` when every candidate is kept).
    """
    if int8 is None and policies.default:
        r = layer.router(tokens)
        return r.topk_ids, r.topk_weights, None
    from moetrain.moe.router import route

    c = layer.config
    p, lo, hi = _token_bounds(c, policies, tokens.shape[0])
    groups, topk_groups = c.router.num_groups, c.router.topk_groups
    e = c.num_experts
    eligible = (topk_groups or groups) * (e // groups)
    kmax = min(int(hi.max()), eligible)
    with torch.autocast(device_type=tokens.device.type, enabled=False):
        logits = int8.logits(tokens) if int8 is not None else F.linear(tokens.float(), layer.router.weight.float())
    r = route(logits, kmax, score_func=c.router.score_func, norm_topk_prob=False, routed_scaling_factor=1.0,
              num_groups=groups, topk_groups=topk_groups, expert_bias=layer.router.e_score_correction_bias)
    ids = r.topk_ids
    k = tokens_k(r.probs.gather(1, ids), p, lo, hi.clamp(max=kmax))  # [T]
    keep = torch.arange(kmax)[None, :] < k[:, None]  # [T, Kmax]
    w = torch.where(keep, r.topk_weights, 0.0)
    if c.router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)  # the training router's renormalisation, over kept experts
    scale = c.router.routed_scaling_factor
    if scale != 1.0:
        w = w * scale
    return ids, w, None if bool(keep.all()) else keep


class StepRouting:
    """The routing of one engine step through every MoE layer: a :data:`~moetrain.moe.layer.RoutingHook` given to
    the model's blocks (``MoELayer.forward(x, routing=...)``), which records each layer's :class:`MoEStepStats`.

    Args:
        policies: the step's :class:`StepPolicies`.
        int8_routers: MoE layer -> :class:`~moetrain.serve.routing.Int8Router` routing it instead of its fp32 router
            weight (empty: fp32 routers).
    Attributes:
        stats: one :class:`MoEStepStats` per MoE layer called, in call (block) order.
    """

    def __init__(self, policies: StepPolicies, int8_routers: Mapping[object, Int8Router] | None = None):
        self.policies, self.int8_routers = policies, int8_routers or {}
        self.stats: list[MoEStepStats] = []

    def __call__(self, layer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids, weights, keep = route_with_policy(layer, tokens, self.policies, self.int8_routers.get(layer))
        kept_ids = ids if keep is None else ids[keep]
        counts = torch.bincount(kept_ids.reshape(-1), minlength=layer.config.num_experts)
        k_used = torch.full((ids.shape[0],), ids.shape[1]) if keep is None else keep.sum(dim=1)
        self.stats.append(MoEStepStats(counts, int(kept_ids.numel()), k_used))
        return ids, weights, keep
