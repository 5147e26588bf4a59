"""Distributed training: the trainer's hooks, and :func:`start`, which picks them from ``torchrun``'s world.

    torchrun --nproc_per_node 4 -m moetrain train --preset tiny parallel.ep=2      # 2 replicas x ep 2

Every ``torchrun`` job (``WORLD_SIZE > 1``) runs on one engine (:class:`moetrain.parallel.engine.ShardedHooks`;
docs/scale-out.md). One process runs the :class:`ParallelHooks` here, whose hooks are the identity; they are also
the engine's base. Each hook that is a collective says so: every rank calls it at the same point. Only rank 0
writes logs, metrics and run files.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.distributed as dist
from torch import nn

from moetrain.errors import ConfigError, MoetrainError
from moetrain.parallel import ac as activation_checkpointing
from moetrain.parallel.all_gather import AllGatherDispatcher
from moetrain.parallel.all_to_all import AllToAllDispatcher
from moetrain.parallel.comm import CommStats, named_collective
from moetrain.parallel.dcp import ShardLayout
from moetrain.parallel.exchange import all_gather_rows
from moetrain.parallel.layout import (ExpertShard, Layout, ParallelMesh, init_layout_mesh, moe_layers, shard_experts,
                                      single_process)

if TYPE_CHECKING:  # imported where used at run time (train/ imports this module)
    from moetrain.config import Config
    from moetrain.data.batch import Batch
    from moetrain.data.config import DataConfig
    from moetrain.model.config import ModelConfig
    from moetrain.train.config import TrainConfig
    from moetrain.train.monitor import RoutingMonitor, StageRouting
    from moetrain.train.monitor_config import MonitorConfig
    from moetrain.train.step import StepResult

DISPATCHERS = {"all_to_all": AllToAllDispatcher, "all_gather": AllGatherDispatcher}


def parallelize(model: nn.Module, mesh: ParallelMesh, dispatcher: str = "all_to_all",
                stats: CommStats | None = None, activation_checkpoint: str = "none") -> dict[str, ExpertShard]:
    """Shard every MoE layer's experts over the EP group and attach an expert-parallel dispatcher, then activation
    checkpointing (:mod:`moetrain.parallel.ac`; after the dispatchers, so a recompute repeats their exchange).

    Args:
        model: a full model, identical on every rank (same seed), not yet given to an optimizer.
        mesh: this rank's mesh position.
        dispatcher: ``all_to_all`` or ``all_gather``.
        stats: communication counters shared by every layer's dispatcher.
        activation_checkpoint: ``parallel.activation_checkpoint``.
    Returns:
        The expert shards (``{parameter name: ExpertShard}``; empty when ``ep == 1``, where the local
        dispatcher stays and experts are replicated like any other parameter).
    Raises:
        ConfigError: an unknown dispatcher or checkpointing mode, or ``ep`` not dividing a layer's experts.
    """
    if dispatcher not in DISPATCHERS:
        raise ConfigError(f"parallel.dispatcher: unknown dispatcher {dispatcher!r}; choose one of "
                          f"{sorted(DISPATCHERS)}")
    plan = shard_experts(model, mesh)
    if mesh.ep > 1:
        for name, layer in moe_layers(model):
            layer.set_dispatcher(DISPATCHERS[dispatcher](layer.config.num_experts, mesh, stats, name=name))
    activation_checkpointing.apply(model, activation_checkpoint)
    return plan


class NullMetrics:
    """What ranks other than 0 log to: nothing (same interface as ``MetricsLogger``)."""

    writer = None

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class ParallelHooks:
    """The trainer's view of one rank (see the module docstring): for a single process
    (``ParallelHooks(single_process(device))``) every hook is the identity and checkpoints keep the single-file
    format, but a sharded checkpoint can still be loaded (resharded to one process); the base of the engine's
    :class:`~moetrain.parallel.engine.ShardedHooks`.

    Args:
        mesh: this rank's expert-parallel view (:class:`~moetrain.parallel.layout.ParallelMesh`).
        dispatcher: ``parallel.dispatcher``.
        owns_group: destroy the default process group in :meth:`close` (it was created by :func:`start`).
        activation_checkpoint: ``parallel.activation_checkpoint``, attached in :meth:`prepare_model`
            (:mod:`moetrain.parallel.ac`).
    """

    def __init__(self, mesh: ParallelMesh, dispatcher: str = "all_to_all", owns_group: bool = False,
                 activation_checkpoint: str = "none"):
        self.mesh = mesh
        self.dispatcher = dispatcher
        self.owns_group = owns_group
        self.activation_checkpoint = activation_checkpoint
        self.stats = CommStats()
        self.plan: dict[str, ExpertShard] = {}
        self.model: nn.Module | None = None
        self._steps = 0  # optimizer steps since the last step_metrics()

    @property
    def is_main(self) -> bool:
        return self.mesh.is_main

    # -- model and data ---------------------------------------------------------------------------------------
    def build_model(self, config: ModelConfig, device: torch.device, seed: int = 0) -> nn.Module:
        """The whole model on ``device``, initialised from global indices and ``seed`` (``train.seed``;
        :mod:`moetrain.parallel.meta_init`): the weights every layout starts from. Built on the meta device first,
        so no value is drawn twice. :class:`~moetrain.parallel.engine.ShardedHooks` keeps it on the meta device
        and materialises this rank's shards only."""
        from moetrain.parallel.meta_init import build_meta, materialise

        return materialise(build_meta(config), config, device, seed)

    def prepare_model(self, model: nn.Module, log: Callable[[str], None] | None = None) -> nn.Module:
        """Shard the experts over ``mesh.ep`` ranks and attach their dispatchers (none in one process), then
        activation checkpointing (call before building the optimizer)."""
        self.plan = parallelize(model, self.mesh, self.dispatcher, self.stats, self.activation_checkpoint)
        self.model = model
        return model

    def local_batch(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """This rank's rows of each global micro-batch: all of them in one process."""
        return next_batch

    def prepare_data(self, prepare: Callable[[], tuple[Any, bytes]], data_config: DataConfig, vocab_size: int
                     ) -> tuple[Any, bytes]:
        """Rank 0 runs ``prepare()`` (tokenizer training, tokenization, cache) first; the other ranks then prepare
        the same corpus with rank 0's tokenizer (a cache hit on the same node), so every rank tokenizes
        identically. A failure on rank 0 is reported by every rank (one broadcast).

        Args:
            prepare: the trainer's own data preparation, returning (prepared data, tokenizer.json bytes).
            data_config: the run's ``data`` section, for the other ranks' ``prepare_data``.
            vocab_size: the tokenizer's vocabulary size, for the other ranks' ``prepare_data``.
        Raises:
            MoetrainError: rank 0's data preparation failed (its message).
        """
        if not self.mesh.distributed:
            return prepare()
        from moetrain.data.dataset import prepare_data

        # rank 0's outcome: ("ok", tokenizer.json bytes) or ("error", message)
        message: list[tuple[str, bytes | str] | None] = [None]
        try:
            if self.is_main:
                result = prepare()
                message = [("ok", result[1])]
        except Exception as e:  # the other ranks report it instead of waiting for a tokenizer
            message = [("error", str(e) if isinstance(e, MoetrainError) else f"{type(e).__name__}: {e}")]
            raise
        finally:
            with named_collective("broadcast_object_list (tokenizer from rank 0)"):
                dist.broadcast_object_list(message, src=0)
        if self.is_main:
            return result
        outcome = message[0]
        assert outcome is not None  # filled by rank 0's broadcast
        _, payload = outcome
        if isinstance(payload, str):  # ("error", message)
            raise MoetrainError(f"rank 0 could not prepare the data: {payload}")
        with tempfile.TemporaryDirectory(prefix="moetrain-tok-") as tmp:
            path = Path(tmp) / "tokenizer.json"
            path.write_bytes(payload)
            data = prepare_data(data_config, vocab_size, tokenizer_path=path, log=lambda _: None)
        return data, payload

    # -- the step ---------------------------------------------------------------------------------------------
    def train_step(self, model: nn.Module, next_batch: Callable[[], Batch], optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, config: TrainConfig, device: torch.device
                   ) -> StepResult:
        """One optimizer step (:func:`moetrain.train.step.train_step` with :meth:`step_kwargs`)."""
        from moetrain.model.transformer import MoETransformer
        from moetrain.train.step import train_step

        # the model build_model made (a MoETransformer, experts sharded in place)
        return train_step(cast(MoETransformer, model), next_batch, optimizer, scheduler, config, device,
                          **self.step_kwargs())

    def evaluate(self, model: nn.Module, batches: Iterable[Batch], device: torch.device, dtype: str) -> float:
        """Validation loss (:func:`moetrain.train.trainer.evaluate`)."""
        from moetrain.model.transformer import MoETransformer
        from moetrain.train.trainer import evaluate

        return evaluate(cast(MoETransformer, model), batches, device, dtype)

    def step_kwargs(self) -> dict[str, Any]:
        """Extra arguments of :func:`moetrain.train.step.train_step` (none for a single process)."""
        return {}

    def step_metrics(self) -> dict[str, float]:
        """Per-rank communication per optimizer step since the last call (a collective: an all-gather of six
        counters), as metrics fields ``ep/rank{R}/tokens_received``, ``ep/rank{R}/a2a_bytes_sent`` (rows put into
        the dispatch exchange x D x element size), ``ep/rank{R}/a2a_bytes_sent_remote`` (the part bound for other
        ranks) and ``ep/rank{R}/combine_bytes_sent``. Counters cover training forward passes only."""
        if not self.mesh.distributed or self.mesh.ep == 1:
            return {}
        everyone = all_gather_rows(self.stats.as_tensor().to(self.mesh.device)[None], None, self.mesh.world_size,
                                   "all_gather (communication counters)")  # [W, 6]
        steps = max(self._steps, 1)
        self.stats.reset()
        self._steps = 0
        names = {"tokens_received": "tokens_received", "dispatch_bytes_sent": "a2a_bytes_sent",
                 "dispatch_bytes_sent_remote": "a2a_bytes_sent_remote", "combine_bytes_sent": "combine_bytes_sent"}
        ranks = [CommStats(*counters.tolist()) for counters in everyone]
        return {f"ep/rank{rank}/{key}": getattr(values, field) / steps
                for rank, values in enumerate(ranks) for field, key in names.items()}

    # -- checkpoints, monitoring, stopping ---------------------------------------------------------------------
    @property
    def layout(self) -> ShardLayout:
        """This rank's mesh and expert shards (set by :meth:`prepare_model`), what a
        :class:`~moetrain.train.checkpointer.Checkpointer` saves and loads through."""
        return ShardLayout(self.mesh, self.plan)

    def monitor_config(self, config: MonitorConfig) -> MonitorConfig:
        """The routing monitor's config for this rank: enabled on rank 0 (it sees rank 0's tokens and writes the
        alerts) and on the ranks whose :meth:`stage_routing` reaches rank 0 (the later stages' MoE layers of rank 0's
        pipeline); disabled on the others."""
        mine = self.is_main or self.stage_routing() is not None
        return config if mine else dataclasses.replace(config, enabled=False)

    def stage_routing(self) -> StageRouting | None:
        """How this rank's routing monitor reaches rank 0 when the model is split into pipeline stages
        (:class:`~moetrain.train.monitor.StageRouting`); ``None`` here: every rank holds every layer."""
        return None

    def raise_if_fatal(self, monitor: RoutingMonitor, checkpoint: Callable[[], Any]) -> None:
        """``monitor.raise_if_fatal(checkpoint)`` with the decision made on rank 0 and shared (one broadcast),
        so that every rank writes the checkpoint (a collective) and stops together.

        Raises:
            TrainingAlarm: on rank 0.  MoetrainError: on the other ranks, naming rank 0's alarm.
        """
        if not self.mesh.distributed:
            monitor.raise_if_fatal(checkpoint)
            return
        alert = monitor.alerts.fatal if self.is_main else None
        fatal = [alert.kind if alert is not None else None]
        with named_collective("broadcast_object_list (routing alarm from rank 0)"):
            dist.broadcast_object_list(fatal, src=0)
        if fatal[0] is None:
            return
        if fatal[0] != "nonfinite_loss":  # as RoutingMonitor.raise_if_fatal: weights may be non-finite then
            checkpoint()
        if self.is_main:
            monitor.raise_if_fatal(None)
        raise MoetrainError("stopped with rank 0: its routing monitor raised a fatal alarm (see rank 0's log)")

    def agree_stop(self, received: str | None) -> str | None:
        """The stop signal if any rank received one (one all-reduce per step), so all ranks stop after the same
        step; ``None`` otherwise."""
        if not self.mesh.distributed:
            return received
        flag = torch.tensor([1 if received else 0], device=self.mesh.device)
        with named_collective("all_reduce (stop signal)"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) == 0:
            return None
        return received or "a signal received by another rank"

    def close(self) -> None:
        """Destroy the default process group if :func:`start` created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def start(config: Config, device_type: str) -> ParallelHooks:
    """Join the ``torchrun`` job (``WORLD_SIZE`` > 1: the engine's :class:`~.engine.ShardedHooks` on the mesh of
    :func:`~.layout.init_layout_mesh`) or stay a single process, per the run config.

    Args:
        config: the run :class:`~moetrain.config.Config` (its ``parallel`` section).
        device_type: ``cpu`` or ``cuda``.
    Raises:
        ConfigError: an impossible mesh (the message names the ``parallel`` fields and the world size, as
            ``--dry-run`` does), NCCL on a CPU run, or ``parallel.cpu_offload`` on the plain data-parallel path.
    """
    import os

    p, world = config.parallel, int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and p.ep != 1 and p.pp == p.dp_shard == 1:
        raise ConfigError(f"parallel.ep: ep={p.ep} needs {p.ep} processes; launch with "
                          f"`torchrun --nproc_per_node {p.ep} -m moetrain train ...`")
    layout = Layout.from_config(p, world)  # the mesh sizes --dry-run checks
    if world > 1:  # FSDP2 + DeviceMesh: every torchrun layout
        from moetrain.parallel.engine import ShardedHooks

        mesh, owns = init_layout_mesh(p, device_type)
        micro = (config.train.batch_size // layout.data_parallel, config.data.seq_len)
        return ShardedHooks(mesh, p, config.train.dtype, config.train.seed, owns_group=owns,
                            grad_accum=config.train.grad_accum, micro_shape=micro)
    if p.cpu_offload:
        raise ConfigError("parallel.cpu_offload: offloads FSDP2 shards, but one process trains whole weights (and "
                          "FSDP2's CPUOffloadPolicy needs CUDA); set it to false")
    return ParallelHooks(single_process(device_type), p.dispatcher, activation_checkpoint=p.activation_checkpoint)
