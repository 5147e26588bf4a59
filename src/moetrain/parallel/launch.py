"""Distributed training: join the ``torchrun`` job, build the DP x EP mesh, shard the experts, attach the
dispatchers, and hand the trainer the hooks that make N ranks train exactly like one process on the same global
batch.

    torchrun --nproc_per_node 4 -m moetrain train --preset tiny parallel.ep=2      # dp = 4 / 2 = 2

What the hooks do (each is a collective where it says so; every rank calls it at the same point):

- ``prepare_model``: shard the experts (each EP rank keeps E / ep) and attach the all-to-all (or all-gather)
  dispatcher to every MoE layer;
- ``local_batch``: every rank draws the same global micro-batch and keeps its own ``batch_size / world`` rows,
  so the data order (and a resumed sampler) is that of one process;
- ``count_reducer``: expert counts summed over all ranks (global-batch aux loss, aux-loss-free bias update);
- ``sync_grads``: gradients averaged as one process would have computed them, then clipped by the global norm
  (:mod:`moetrain.parallel.grads`);
- ``reduce_mean``: the step's losses averaged over ranks (what is logged, and what the non-finite check sees);
- ``step_metrics``: per-rank tokens received and bytes sent by the token exchange, per step (rank 0 logs them);
- checkpoints: :mod:`moetrain.parallel.dcp`.

Only rank 0 writes logs, metrics and run files.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from moetrain.errors import ConfigError
from moetrain.parallel.all_gather import AllGatherDispatcher
from moetrain.parallel.all_to_all import AllToAllDispatcher
from moetrain.parallel.comm import CommStats, named_collective
from moetrain.parallel.grads import all_reduce_mean, clip_grad_norm, sync_gradients
from moetrain.parallel.mesh import ParallelMesh
from moetrain.parallel.sharding import ExpertShard, moe_layers, shard_experts

DISPATCHERS = {"all_to_all": AllToAllDispatcher, "all_gather": AllGatherDispatcher}


def parallelize(model: nn.Module, mesh: ParallelMesh, dispatcher: str = "all_to_all",
                stats: CommStats | None = None) -> dict[str, ExpertShard]:
    """Shard every MoE layer's experts over the EP group and attach an expert-parallel dispatcher.

    Args:
        model: a full model, identical on every rank (same seed), not yet given to an optimizer.
        mesh: this rank's mesh position.
        dispatcher: ``all_to_all`` or ``all_gather``.
        stats: communication counters shared by every layer's dispatcher.
    Returns:
        The expert shards (``{parameter name: ExpertShard}``; empty when ``ep == 1``, where the local
        dispatcher stays and experts are replicated like any other parameter).
    Raises:
        ConfigError: an unknown dispatcher, or ``ep`` not dividing a layer's experts.
    """
    if dispatcher not in DISPATCHERS:
        raise ConfigError(f"parallel.dispatcher: unknown dispatcher {dispatcher!r}; choose one of {sorted(DISPATCHERS)}")
    plan = shard_experts(model, mesh)
    if mesh.ep > 1:
        for name, layer in moe_layers(model):
            layer.set_dispatcher(DISPATCHERS[dispatcher](layer.config.num_experts, mesh, stats, name=name))
    return plan


class ParallelHooks:
    """The trainer's view of one rank of a DP x EP job (see the module docstring).

    Args:
        mesh: this rank's mesh position.
        dispatcher: ``parallel.dispatcher``.
    """

    def __init__(self, mesh: ParallelMesh, dispatcher: str = "all_to_all"):
        self.mesh = mesh
        self.dispatcher = dispatcher
        self.stats = CommStats()
        self.plan: dict[str, ExpertShard] = {}
        self.model: nn.Module | None = None
        self._steps = 0  # optimizer steps since the last step_metrics()

    @property
    def is_main(self) -> bool:
        return self.mesh.is_main

    @property
    def distributed(self) -> bool:
        return self.mesh.distributed

    # -- model and data ---------------------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Shard the experts and attach the dispatchers (call before building the optimizer)."""
        self.plan = parallelize(model, self.mesh, self.dispatcher, self.stats)
        self.model = model
        return model

    def local_batch(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Wrap a sampler's ``next_batch`` (global micro-batch [B, S]) to return this rank's rows
        ``[rank * B / W, (rank + 1) * B / W)``.

        Raises:
            ConfigError: B not divisible by the world size (on the first call).
        """
        w, r = self.mesh.world_size, self.mesh.rank

        def mine() -> tuple[torch.Tensor, torch.Tensor]:
            inputs, targets = next_batch()
            b = inputs.shape[0]
            if b % w:
                raise ConfigError(
                    f"train.batch_size: {b} sequences per micro-batch cannot be split evenly over {w} ranks "
                    f"(WORLD_SIZE); choose a multiple of {w}"
                )
            rows = slice(r * b // w, (r + 1) * b // w)
            return inputs[rows], targets[rows]

        return mine if self.distributed else next_batch

    # -- the step ---------------------------------------------------------------------------------------------
    @property
    def count_reducer(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Sums [L, E] expert counts over all ranks (every rank reads different data); ``None`` for one process."""
        if not self.distributed:
            return None

        def reduce(counts: torch.Tensor) -> torch.Tensor:
            with named_collective("all_reduce (expert counts, all ranks)"):
                dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            return counts

        return reduce

    def sync_grads(self, max_norm: float) -> torch.Tensor:
        """All-reduce the gradients (:func:`~moetrain.parallel.grads.sync_gradients`), clip them to ``max_norm`` by
        the global norm and return it. Called once per optimizer step by ``train_step``."""
        self._steps += 1
        sync_gradients(self.model, self.mesh, set(self.plan))
        return clip_grad_norm(self.model, self.mesh, set(self.plan), max_norm)

    def reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of this rank's losses (1-D)."""
        return all_reduce_mean(values, self.mesh, "step losses, all ranks")

    def step_metrics(self) -> dict[str, float]:
        """Per-rank communication per optimizer step since the last call (a collective: an all-gather of six
        counters), as metrics fields ``ep/rank{R}/tokens_received``, ``ep/rank{R}/a2a_bytes_sent`` (rows put into
        the dispatch exchange x D x element size), ``ep/rank{R}/a2a_bytes_sent_remote`` (the part bound for other
        ranks) and ``ep/rank{R}/combine_bytes_sent``. Counters cover training forward passes only."""
        if not self.distributed or self.mesh.ep == 1:
            return {}
        local = self.stats.as_tensor().to(self.mesh.device)
        everyone = [torch.empty_like(local) for _ in range(self.mesh.world_size)]
        with named_collective("all_gather (communication counters)"):
            dist.all_gather(everyone, local)
        steps = max(self._steps, 1)
        self.stats.reset()
        self._steps = 0
        names = {"tokens_received": "tokens_received", "dispatch_bytes_sent": "a2a_bytes_sent",
                 "dispatch_bytes_sent_remote": "a2a_bytes_sent_remote", "combine_bytes_sent": "combine_bytes_sent"}
        fields = CommStats.field_names()
        out = {}
        for rank, counters in enumerate(everyone):
            values = dict(zip(fields, counters.tolist()))
            for field, key in names.items():
                out[f"ep/rank{rank}/{key}"] = values[field] / steps
        return out
