"""Inference routing policies (dynamic top-k) and the int8 router, applied by the serving engine only.

Legend: T = tokens, D = hidden, E = experts, K = top-k (trained), Kmax = largest k of a step.

Policies (per request or per server):
- ``fixed``: every token uses k experts (default: the trained K; the training router's exact computation).
- ``threshold``: per token, the fewest experts, best first, whose probability mass (the router probs, normalised
  over all E) reaches ``p``, clamped to [k_min, k_max]. Confident tokens use fewer experts.
- ``load``: one k for the whole step, lowered linearly from k_max toward k_min as the engine's queue depth
  (waiting + running requests) grows from ``low`` to ``high``, and restored as it drains.

The chosen experts' gating weights are the router's unbiased scores renormalised over the experts kept (when the
layer renormalises, as it does in training), then scaled by ``routed_scaling_factor``: with k = K this is exactly
the training router's weights.

The policy enters the model as the MoE layers' routing hook (:class:`moetrain.serve.moe.StepRouting`, computed from
the layer's router weights); the training path never sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

POLICIES = ("fixed", "threshold", "load")
# the fields each policy reads; one given for another policy would do nothing, so check_fields refuses it
POLICY_FIELDS = {"fixed": ("k",), "threshold": ("p", "k_min", "k_max"), "load": ("k_min", "k_max", "low", "high")}


def check_fields(policy: str, given) -> None:
    """Refuse fields that ``policy`` does not read.

    Args:
        policy: ``fixed``, ``threshold`` or ``load``.
        given: names of the :class:`RoutingPolicy` fields that were set explicitly (``policy`` itself aside).
    Raises:
        ValueError: ``"FIELD: ..."`` for the first field ``policy`` ignores, naming the policies that read it.
    """
    for name in given:
        if name not in POLICY_FIELDS.get(policy, (name,)):
            readers = [p for p, fields in POLICY_FIELDS.items() if name in fields]
            raise ValueError(f"{name}: only the {' / '.join(readers)} policy reads it, not {policy!r}")


@dataclass(frozen=True, kw_only=True)
class RoutingPolicy:
    """How many experts each token uses at inference.

    Fields:
        policy: ``fixed``, ``threshold`` or ``load`` (see the module docstring).
        k: the fixed policy's k; ``None`` = the trained top-k of each layer.
        p: the threshold policy's probability mass, in (0, 1].
        k_min / k_max: bounds of ``threshold`` and ``load``; ``None`` = 1 / the trained top-k.
        low / high: ``load``: queue depths (waiting + running requests) at which k starts to fall from k_max and
            reaches k_min.
    """

    policy: str = "fixed"
    k: int | None = None
    p: float = 0.9
    k_min: int | None = None
    k_max: int | None = None
    low: int = 8
    high: int = 32

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown routing policy {self.policy!r}; choose one of {list(POLICIES)}")
        for name in ("k", "k_min", "k_max"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if not 0 < self.p <= 1:
            raise ValueError(f"p: must be in (0, 1], got {self.p}")
        if self.k_min is not None and self.k_max is not None and self.k_min > self.k_max:
            raise ValueError(f"k_min: {self.k_min} is larger than k_max={self.k_max}")
        if not 0 <= self.low < self.high:
            raise ValueError(f"low/high: need 0 <= low < high, got low={self.low}, high={self.high}")

    def bounds(self, trained_k: int, num_experts: int) -> tuple[int, int]:
        """(k_min, k_max) for a layer, clamped to [1, E].

        Raises:
            ValueError: k / k_max larger than the layer's E.
        """
        hi = self.k if self.policy == "fixed" and self.k is not None else (self.k_max or trained_k)
        lo = hi if self.policy == "fixed" else (self.k_min or 1)
        if hi > num_experts:
            raise ValueError(f"{'k' if self.policy == 'fixed' else 'k_max'}: {hi} is larger than the layer's "
                             f"{num_experts} experts")
        return min(lo, hi), hi

    def load_k(self, trained_k: int, num_experts: int, depth: int) -> int:
        """The ``load`` policy's k at queue depth ``depth``: k_max up to ``low``, k_min from ``high``, linear
        (rounded) between."""
        lo, hi = self.bounds(trained_k, num_experts)
        frac = min(1.0, max(0.0, (depth - self.low) / (self.high - self.low)))
        return int(round(hi - (hi - lo) * frac))

    def is_default(self) -> bool:
        """True for ``fixed`` with the trained k (the training router's exact computation)."""
        return self.policy == "fixed" and self.k is None


def tokens_k(probs_sorted: torch.Tensor, p: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor) -> torch.Tensor:
    """Per-token k of the threshold rule.

    Args:
        probs_sorted: [T, Kmax] router probs of each token's candidates, best first.
        p: [T] mass to reach (> 1 never reached: then k = k_max).
        k_min / k_max: [T] int64 bounds.
    Returns:
        [T] int64 the fewest leading candidates whose mass reaches p, clamped to [k_min, k_max].
    """
    before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass of the candidates ranked above each one
    needed = (before < p[:, None]).sum(dim=-1)  # candidates taken while the mass is still short of p
    return torch.minimum(torch.maximum(needed, k_min), k_max)


class Int8Router:
    """A router weight [E, D] stored as int8 with one fp32 scale per row (expert): ``W ~= q * scale[:, None]``,
    the experts' quantisation (:meth:`~moetrain.serve.quant_experts.Int8Weight.quantize`: ``scale = max |W_e| /
    127``, symmetric, round to nearest). Logits are ``(x @ q^T) * scale`` in fp32; the int8 matrix is what is kept
    (4x smaller), the product runs on the dequantised fp32 copy made per call (CPU has no int8 GEMM in PyTorch that
    beats it at E x D this small).

    Args:
        weight: [E, D] float router weight.
    """

    def __init__(self, weight: torch.Tensor):
        from moetrain.serve.quant_experts import Int8Weight

        w = Int8Weight.quantize(weight[None])  # one "expert" [1, E, D]
        self.q, self.scale = w.q[0], w.scale[0]  # [E, D] int8, [E] fp32

    def dequantized(self) -> torch.Tensor:
        """[E, D] fp32 ``q * scale``."""
        return self.q.float() * self.scale[:, None]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, E] fp32 logits."""
        return F.linear(x.float(), self.q.float()) * self.scale

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4
