"""AdamW's parameter groups: which tensors decay, by how much, and at which multiple of ``train.lr`` they learn.

One pure function of the parameters' names and shapes and the config (:func:`param_groups`), so the trainer's
optimizer (:func:`moetrain.train.trainer.build_optimizer`) and ``moetrain train --dry-run`` (which prints the groups
of the meta model: :mod:`moetrain.parallel.dry_run`) cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moetrain.config import Config


def lr_scale(name: str, config: Config) -> float:
    """The multiple of ``train.lr`` for parameter ``name`` (an FQN): ``train.router_lr_scale`` for an MoE router's
    gate (``...ffn.router.weight``), ``train.expert_lr_scale`` for a routed expert tensor (``...ffn.experts.*``;
    not the shared expert), else 1."""
    if ".router." in name:
        return config.train.router_lr_scale
    if ".experts." in name:
        return config.train.expert_lr_scale
    return 1.0


def weight_decay(name: str, config: Config) -> float:
    """AdamW's decoupled weight decay for matrix parameter ``name`` (an FQN): ``train.expert_weight_decay`` for a
    routed expert tensor (``...ffn.experts.*``; not the shared expert) when it is set, else ``train.weight_decay``.
    Norms and biases are never decayed (:func:`param_groups`)."""
    if ".experts." in name and config.train.expert_weight_decay is not None:
        return config.train.expert_weight_decay
    return config.train.weight_decay


@dataclass
class ParamGroup:
    """One AdamW parameter group.

    Attributes:
        role: what it holds, for people: ``matrices``, ``norms and biases`` (each ``(with the routers and routed
            experts)`` when they hold them), ``routers``, ``routed experts`` or ``routers + routed experts`` (with
            `` (not decayed)`` for tensors of dim < 2).
        lr_scale: the multiple of ``train.lr`` (the schedule multiplies it: train/schedule.py).
        weight_decay: AdamW's decoupled decay.
        names / params: its tensors' FQNs and the tensors, in ``named_parameters()`` order.
    """

    role: str
    lr_scale: float
    weight_decay: float
    names: list[str] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements of all its tensors (shapes only: works on the meta device)."""
        return sum(p.numel() for p in self.params)


def _kinds(names: list[str]) -> list[str]:
    """The kinds of tensor among ``names`` that may have a group of their own: ``routers``, ``routed experts``."""
    kinds = (("routers", ".router."), ("routed experts", ".experts."))
    return [kind for kind, key in kinds if any(key in n for n in names)]


def param_groups(named: Iterable[tuple[str, torch.Tensor]], config: Config) -> list[ParamGroup]:
    """The AdamW groups of the trainable tensors of ``named`` (``model.named_parameters()``; meta tensors work).

    Weight decay on matrices and expert tensors (dim >= 2) only, not on norms or biases. Groups: ``matrices``
    (decayed at ``train.weight_decay``), then ``norms and biases`` (not decayed), both at ``train.lr`` and always
    present (possibly empty); then one group per (:func:`lr_scale`, decay) for the router and expert tensors whose
    scale is not 1 or whose :func:`weight_decay` is their own, in the order their first tensor appears. With both
    scales at 1 and no ``train.expert_weight_decay`` there are exactly the first two groups. The order is the
    optimizer state's layout in a checkpoint: keep it.

    Returns:
        The groups; every tensor of ``named`` with ``requires_grad`` is in exactly one.
    """
    t = config.train
    by_key: dict[tuple[float, bool, float], ParamGroup] = {  # (lr scale, decayed, decay): the two always there first
        (1.0, True, t.weight_decay): ParamGroup("matrices", 1.0, t.weight_decay),
        (1.0, False, 0.0): ParamGroup("norms and biases", 1.0, 0.0)}
    for name, p in named:
        if not p.requires_grad:
            continue
        decay = p.dim() >= 2
        scale, wd = lr_scale(name, config), weight_decay(name, config) if decay else 0.0
        group = by_key.setdefault((scale, decay, wd), ParamGroup("", scale, wd))
        group.names.append(name)
        group.params.append(p)
    for (_, decay, _), g in by_key.items():  # named once filled, by the kinds of tensor they hold
        kinds = _kinds(g.names)
        if not g.role:  # a group of its own for routers / experts
            g.role = " + ".join(kinds) + ("" if decay else " (not decayed)")
        elif kinds:  # the routers / experts without a scale or decay of their own
            g.role += f" (with the {' and '.join(kinds)})"
    return list(by_key.values())
