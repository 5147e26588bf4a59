"""Expert-parallel serving: ``torchrun --nproc_per_node N -m moetrain serve RUN_DIR parallel.ep=N``.

Legend: T = tokens of an engine step, D = hidden, E = experts, P = ep (ranks), T_r = this rank's share of T.

Every rank holds the whole model except the routed experts, of which it keeps ``E / P`` per layer (the training
sharding, :func:`moetrain.parallel.sharding.shard_experts`), and each MoE layer's dispatcher is the training
all-to-all dispatcher (:class:`moetrain.parallel.all_to_all.AllToAllDispatcher`). Rank 0 runs the HTTP front and
the engine; before each engine step it broadcasts the step (its :class:`~moetrain.serve.forward.StepBatch` and
routing policies) to the other ranks, which run the same step (:func:`follow`). So attention, norms, routers and
the KV caches are replicated (every rank computes them for all T tokens; cheap next to the experts at E / P), and
in each MoE layer rank r sends only its contiguous share T_r of the tokens through the all-to-all, where each
token's rows go to the ranks holding its experts; the T_r outputs come back, and an all-gather over the EP group
gives every rank all T (:func:`ep_experts_fn`). Expert FLOPs are not repeated: each (token, expert) pair is
computed once, on the expert's rank.

When idle, rank 0 broadcasts a heartbeat every ``min(HEARTBEAT_S, parallel.timeout_s / 4)`` seconds so the other
ranks' waiting collective never reaches ``parallel.timeout_s``; at shutdown it broadcasts a stop.

Outputs equal the single-process server (tests/test_serve_expert_parallel.py: same greedy tokens over HTTP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moetrain.errors import MoetrainError
from moetrain.serve.moe import experts_forward

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


def shard_for_serving(model, mesh) -> None:
    """Keep this rank's ``E / ep`` experts of every MoE layer and give each layer the all-to-all dispatcher.

    Raises:
        ConfigError: ``ep`` does not divide the experts (from :func:`~moetrain.parallel.sharding.shard_experts`).
    """
    from moetrain.parallel.all_to_all import AllToAllDispatcher
    from moetrain.parallel.sharding import moe_layers, shard_experts

    shard_experts(model, mesh)
    for name, layer in moe_layers(model):
        layer.dispatcher = AllToAllDispatcher(layer.config.num_experts, mesh, name=name)


def ep_experts_fn(mesh):
    """The ``experts_fn`` of an EP rank (see :func:`moetrain.serve.moe.serve_moe`): tokens [T, D], ids / weights
    [T, K], keep [T, K] or ``None`` -> [T, D]; rank r dispatches tokens ``[r * ceil(T/P), ...)`` only."""

    def fn(layer, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None
           ) -> torch.Tensor:
        t, p = tokens.shape[0], mesh.ep
        per = -(-t // p)  # ceil
        lo, hi = min(t, mesh.ep_rank * per), min(t, (mesh.ep_rank + 1) * per)
        part = experts_forward(layer, tokens[lo:hi], ids[lo:hi], weights[lo:hi],
                               None if keep is None else keep[lo:hi])  # [T_r, D]; every rank takes part
        buf = tokens.new_zeros(per, tokens.shape[1])
        buf[:hi - lo] = part
        pieces = [torch.empty_like(buf) for _ in range(p)]
        dist.all_gather(pieces, buf, group=mesh.ep_group)
        return torch.cat(pieces)[:t]

    return fn


class BroadcastRunner:
    """Rank 0's step runner: broadcasts each step to the other ranks, then runs it (same ``step`` signature as
    :class:`~moetrain.serve.forward.StepRunner`)."""

    def __init__(self, runner, mesh):
        self.runner, self.mesh = runner, mesh

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
