"""Expert-parallel serving: ``torchrun --nproc_per_node N -m moetrain serve RUN_DIR parallel.ep=N``.

Legend: T = tokens of an engine step, D = hidden, E = experts, P = ep (ranks), T_r = this rank's share of T.

Every rank holds the whole model except the routed experts, of which it keeps ``E / P`` per layer (the training
sharding, :func:`moetrain.parallel.layout.shard_experts`), and each MoE layer's dispatcher is the training
all-to-all dispatcher (:class:`moetrain.parallel.all_to_all.AllToAllDispatcher`). Rank 0 runs the HTTP front and
the engine; before each engine step it broadcasts the step (its :class:`~moetrain.serve.forward.StepBatch` and
routing policies) to the other ranks, which run the same step (:func:`follow`). So attention, norms, routers and
the KV caches are replicated (every rank computes them for all T tokens; cheap next to the experts at E / P), and
in each MoE layer rank r sends only its contiguous share T_r of the tokens through the all-to-all, where each
token's rows go to the ranks holding its experts; the T_r outputs come back, and an all-gather over the EP group
gives every rank all T (:class:`StepShareDispatcher`, each MoE layer's dispatcher). Expert FLOPs are not repeated: each (token, expert) pair is
computed once, on the expert's rank.

With ``--placement FILE`` (written by ``moetrain placement RUN --ep N --redundant R``) each layer's experts are laid
out as the file's physical experts instead (P = E + R, P / N per rank, the hottest replicated): a token routed to a
replicated expert x is sent to replica ``t % replicas[x]`` of x (t = its index in the step), the same choice on
every rank, so a hot expert's tokens are split evenly over its replicas as the placement's predicted load assumes.

When idle, rank 0 broadcasts a heartbeat every ``min(HEARTBEAT_S, parallel.timeout_s / 4)`` seconds so the other
ranks' waiting collective never reaches ``parallel.timeout_s``; at shutdown it broadcasts a stop.

Outputs equal the single-process server (tests/test_serve_expert_parallel.py: same greedy tokens over HTTP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moetrain.errors import MoetrainError
from moetrain.moe.dispatcher import Dispatcher

HEARTBEAT_S = 10.0  # idle seconds between heartbeats; far below parallel.timeout_s (600 s by default)
_ALLOWED = ("ep", "timeout_s", "backend")


def parallel_config(overrides: list[str]):
    """The ``parallel`` section from ``serve``'s ``parallel.FIELD=VALUE`` arguments (``ep``, ``timeout_s``,
    ``backend``).

    Raises:
        MoetrainError: an argument that is not ``parallel.<one of those>=VALUE``, or an invalid value (naming it).
    """
    from moetrain.configlib import parse_overrides
    from moetrain.parallel.config import ParallelConfig

    try:
        d = parse_overrides(overrides)
    except ValueError as e:
        raise MoetrainError(str(e)) from None
    keys = [item.partition("=")[0].strip() for item in overrides]
    bad = [k for k in keys if k not in [f"parallel.{a}" for a in _ALLOWED]]
    if bad:
        raise MoetrainError(f"{bad[0]}: serve takes only parallel.ep, parallel.timeout_s and parallel.backend")
    try:
        return ParallelConfig(**d.get("parallel", {}))
    except (TypeError, ValueError) as e:
        raise MoetrainError(f"parallel.{e}") from None


def shard_for_serving(model, mesh, placement: dict | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Keep this rank's experts of every MoE layer and give each layer the all-to-all dispatcher.

    Without ``placement``: the training sharding, ``E / ep`` consecutive experts per rank. With ``placement`` (MoE
    block -> :class:`~moetrain.serve.placement.LayerPlacement`, from :func:`~moetrain.serve.placement.load_placement`):
    the layer's P = E + R physical experts (``physical_to_logical`` [P], rank-major) are laid out and rank r keeps
    physical experts ``[r * P / ep, (r + 1) * P / ep)``, a replicated expert's weights copied onto each of its
    ranks; the dispatcher then works on physical ids (``AllToAllDispatcher(P)``), and
    :class:`StepShareDispatcher` maps each routed (token, logical expert) to one of the expert's replicas.

    Returns:
        ``id(layer)`` -> (physical ids [E, Rmax] int64 of each logical expert's replicas, padded with its first;
        replicas [E] int64) for every placed layer (empty without ``placement``).
    Raises:
        ConfigError: ``ep`` does not divide the experts (from :func:`~moetrain.parallel.layout.shard_experts`).
        MoetrainError: ``placement`` misses a MoE block, or its P is not divisible by ``ep``.
    """
    from torch import nn

    from moetrain.parallel.all_to_all import AllToAllDispatcher
    from moetrain.parallel.layout import moe_layers, shard_experts

    if placement is None:
        shard_experts(model, mesh)
        for name, layer in moe_layers(model):
            layer.set_dispatcher(StepShareDispatcher(AllToAllDispatcher(layer.config.num_experts, mesh, name=name),
                                                     mesh))
        return {}
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for b, block in enumerate(model.blocks):
        if not block.is_moe:
            continue
        if b not in placement:
            raise MoetrainError(f"--placement: no map for MoE block {b}")
        layer, phys = block.ffn, list(placement[b].physical_to_logical)
        if len(phys) % mesh.ep:
            raise MoetrainError(f"--placement: block {b} has {len(phys)} physical experts, not divisible by "
                                f"parallel.ep={mesh.ep}")
        per = len(phys) // mesh.ep
        mine = torch.tensor(phys[mesh.ep_rank * per:(mesh.ep_rank + 1) * per])
        with torch.no_grad():
            for pname, param in list(layer.experts.named_parameters(recurse=False)):
                setattr(layer.experts, pname, nn.Parameter(param.detach()[mine].clone(), requires_grad=False))
        e = layer.config.num_experts
        where = [[i for i, x in enumerate(phys) if x == lg] for lg in range(e)]
        width = max(len(w) for w in where)
        table = torch.tensor([w + [w[0]] * (width - len(w)) for w in where], dtype=torch.int64)  # [E, Rmax]
        tables[id(layer)] = (table, torch.tensor([len(w) for w in where], dtype=torch.int64))
        layer.set_dispatcher(StepShareDispatcher(AllToAllDispatcher(len(phys), mesh, name=f"blocks.{b}.ffn"), mesh,
                                                 tables[id(layer)]))
    return tables


def physical_ids(ids: torch.Tensor, table: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
    """Logical expert ids [T, K] -> physical ids [T, K]: token t's assignment to expert x goes to replica
    ``t % replicas[x]`` of x (``table`` [E, Rmax], ``replicas`` [E]; see :func:`shard_for_serving`), so a replicated
    expert's tokens are spread evenly over its replicas, the same way on every rank (deterministic)."""
    t = torch.arange(ids.shape[0], dtype=torch.int64)[:, None]  # [T, 1]
    return table[ids, t % replicas[ids]]


class StepShareDispatcher(Dispatcher):
    """The dispatcher of an EP serving rank's MoE layers: every rank holds all T tokens of the step (attention and
    routers are replicated), rank r dispatches only its share ``[r * ceil(T/P), (r + 1) * ceil(T/P))`` through
    ``inner`` (the all-to-all to the experts' ranks; possibly empty when T < P, the rank still takes part), and
    :meth:`combine` all-gathers the shares so that every rank has all T outputs.

    Args:
        inner: an :class:`~moetrain.parallel.all_to_all.AllToAllDispatcher` over ``mesh``'s EP group.
        mesh: the serving mesh (``ep``, ``ep_rank``, ``ep_group``).
        table: (physical ids [E, Rmax], replicas [E]) of a placement (:func:`shard_for_serving`): logical expert
            ids are mapped to physical ones first (:func:`physical_ids`); ``None``: ids are physical already.
    """

    supports_capacity = True

    def __init__(self, inner: Dispatcher, mesh, table: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.inner, self.mesh, self.table = inner, mesh, table
        self.num_experts = inner.num_experts

    def dispatch(self, tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 keep: torch.Tensor | None = None, capacity: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """This rank's share of the T tokens through ``inner`` (see the class docstring)."""
        t, p = tokens.shape[0], self.mesh.ep
        if self.table is not None:
            topk_ids = physical_ids(topk_ids, *self.table)
        per = -(-t // p)  # ceil
        lo, hi = min(t, self.mesh.ep_rank * per), min(t, (self.mesh.ep_rank + 1) * per)
        rows, tokens_per_expert, meta = self.inner.dispatch(
            tokens[lo:hi], topk_ids[lo:hi], topk_weights[lo:hi], keep=None if keep is None else keep[lo:hi],
            capacity=capacity)
        return rows, tokens_per_expert, (meta, t, per, hi - lo)

    def combine(self, expert_out: torch.Tensor, meta: Any) -> torch.Tensor:
        """[T, D] on every rank: this rank's share combined by ``inner``, all-gathered over the EP group."""
        inner_meta, t, per, mine = meta
        part = self.inner.combine(expert_out, inner_meta)  # [T_r, D]
        buf = part.new_zeros(per, part.shape[1])
        buf[:mine] = part
        pieces = [torch.empty_like(buf) for _ in range(self.mesh.ep)]
        dist.all_gather(pieces, buf, group=self.mesh.ep_group)
        return torch.cat(pieces)[:t]


class BroadcastRunner:
    """Rank 0's step runner: broadcasts each step to the other ranks, then runs it (same ``step`` signature as
    :class:`~moetrain.serve.forward.StepRunner`)."""

    def __init__(self, runner, mesh):
        self.runner, self.mesh = runner, mesh

    def __getattr__(self, name: str):
        """Everything but the step (``int8_routers``, ``cache``, ...) is the wrapped runner's."""
        if name == "runner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.runner, name)

    def step(self, batch, policies, all_logits: bool = False):
        _send(("step", batch, policies, all_logits), self.mesh)
        return self.runner.step(batch, policies, all_logits)

    def heartbeat(self) -> None:
        _send(("heartbeat",), self.mesh)

    def stop(self) -> None:
        _send(("stop",), self.mesh)


def _send(message: tuple, mesh) -> None:
    obj: list[Any] = [message]
    dist.broadcast_object_list(obj, src=0, group=mesh.ep_group)


def follow(runner, mesh) -> int:
    """A rank other than 0: run every step rank 0 broadcasts, until it broadcasts a stop. Returns the steps run."""
    steps = 0
    while True:
        obj: list[Any] = [None]
        dist.broadcast_object_list(obj, src=0, group=mesh.ep_group)
        kind = obj[0][0]
        if kind == "stop":
            return steps
        if kind == "step":
            _, batch, policies, all_logits = obj[0]
            runner.step(batch, policies, all_logits)
            steps += 1
