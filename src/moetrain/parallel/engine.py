"""The trainer's hooks for every ``torchrun`` job (how a step runs on them: docs/scale-out.md): the
``pp x dp_replicate x dp_shard x ep`` mesh (:mod:`.layout`), expert slicing and dispatchers, activation
checkpointing (:mod:`.ac`), FSDP2 or ``replicate`` (:mod:`.fsdp`), pipeline stages (:mod:`.pipeline_runner`); the
interface of :class:`~.launch.ParallelHooks`, the one-process hooks. Counts and losses are reduced over the
data-parallel ranks of a pipeline stage (``stage_group``), not the world: the stages hold different layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import DDP

from moetrain.errors import ConfigError
from moetrain.parallel.comm import named_collective
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.dcp import ShardLayout
from moetrain.parallel.fsdp import apply_fsdp, apply_replicate, clip_grad_norm, local_bytes
from moetrain.parallel.launch import ParallelHooks
from moetrain.parallel.layout import LayoutMesh
from moetrain.parallel.meta_init import build_meta
from moetrain.parallel.pipeline_runner import PipelineRunner

if TYPE_CHECKING:
    from moetrain.data.batch import Batch
    from moetrain.model.config import ModelConfig
    from moetrain.model.transformer import MoETransformer
    from moetrain.train.config import TrainConfig
    from moetrain.train.monitor import StageRouting
    from moetrain.train.step import StepResult


class ShardedHooks(ParallelHooks):
    """One rank of an FSDP2 (and EP) job.

    Args:
        mesh: this rank's :class:`LayoutMesh`.
        config: the ``parallel`` section.
        dtype: ``train.dtype`` (mixed-precision policy).
        seed: ``train.seed`` (per-shard initialisation of a model built on the meta device).
        grad_accum: ``train.grad_accum`` (the pipeline's micro-batches per step).
        micro_shape: (rows per rank, ``data.seq_len``) of a micro-batch (the pipeline stages' static shapes).
        owns_group: destroy the default process group in :meth:`close`.
    """

    def __init__(self, mesh: LayoutMesh, config: ParallelConfig, dtype: str = "fp32", seed: int = 0,
                 owns_group: bool = False, grad_accum: int = 1, micro_shape: tuple[int, int] | None = None):
        super().__init__(mesh.ep_mesh, config.dispatcher, owns_group, config.activation_checkpoint)
        self.layout_mesh, self.parallel, self.dtype, self.seed = mesh, config, dtype, seed
        self.grad_accum, self.micro_shape = grad_accum, micro_shape
        self.runner: PipelineRunner | None = None

    def build_model(self, config: ModelConfig, device: torch.device, seed: int = 0) -> nn.Module:
        """The whole model on the meta device (no memory): :meth:`prepare_model` materialises this rank's
        shards only."""
        return build_meta(config)

    def prepare_model(self, model: nn.Module, log: Callable[[str], None] | None = None) -> nn.Module:
        """Slice the experts (EP), attach the dispatchers, wrap blocks for activation checkpointing, then shard
        with FSDP2 (call before building the optimizer); ``log`` gets the mesh line and this rank's bytes."""
        lm = self.layout_mesh
        if lm.layout.pp > 1:  # this rank's stages; the trainer then sees their parameters (LocalModel)
            self.runner = PipelineRunner(cast("MoETransformer", model), lm, self.parallel, self.grad_accum, self.dtype,
                                         self.seed, self.stats, self.micro_shape)
            self.plan, self.model = self.runner.plan, self.runner.local
            if log is not None:
                stages = ", ".join(f"{i} (blocks {self.runner.ranges[i].start}-{self.runner.ranges[i].stop - 1})"
                                 for i in self.runner.indices)
                log(f"parallel: {lm.layout.describe()}; pipeline stages {stages} of {self.runner.n_stages} on this "
                    f"rank ({self.parallel.pp_schedule}, {self.grad_accum} micro-batches per step)")
            return self.runner.local
        super().prepare_model(model)  # expert slices, dispatchers, activation checkpointing
        if self.replicas_only:
            apply_replicate(model, lm, self.parallel.cpu_offload, self.seed, self.plan)
            how = "replicate (plain data parallel: gradients all-reduced in buckets during backward)"
        else:
            apply_fsdp(model, lm, self.parallel, self.dtype, self.seed, self.plan)
            how = "FSDP2 " + ("ZeRO-3" if self.parallel.reshard_after_forward else "ZeRO-2")
        if log is not None:
            held = local_bytes(model)["params"]
            log(f"parallel: {lm.layout.describe()}; {how}, activation checkpointing "
                f"{self.parallel.activation_checkpoint}; rank 0 holds {held / 1e6:.2f} MB of parameters")
        return model

    @property
    def replicas_only(self) -> bool:
        """Plain data parallelism: one shard per replica (``dp_shard * ep == 1``) and no pipeline; the model is
        whole on every rank (:func:`~moetrain.parallel.fsdp.apply_replicate`)."""
        layout = self.layout_mesh.layout
        return layout.dp_shard * layout.ep == 1 and layout.pp == 1

    def local_batch(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """This rank's rows ``[d * B / D, (d + 1) * B / D)`` of each global micro-batch of B, d its data-parallel
        index within the stage and D = dp_replicate * dp_shard * ep, so the data order is one process's.

        Raises:
            ConfigError: B not divisible by the data-parallel ranks of a stage (on the first call).
        """
        d, n = self.layout_mesh.data_rank, self.layout_mesh.layout.data_parallel

        def mine() -> tuple[torch.Tensor, torch.Tensor]:
            inputs, targets = next_batch()
            b = inputs.shape[0]
            if b % n:
                raise ConfigError(
                    f"train.batch_size: {b} sequences per micro-batch cannot be split evenly over the {n} "
                    f"data-parallel ranks of a stage (dp_replicate x dp_shard x ep); choose a multiple of {n}")
            return inputs[d * b // n:(d + 1) * b // n], targets[d * b // n:(d + 1) * b // n]

        return mine if n > 1 else next_batch

    @property
    def count_reducer(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Sums [L, E] expert counts over the data-parallel ranks of this stage."""
        if self.layout_mesh.layout.data_parallel == 1:
            return None
        return functools.partial(self.layout_mesh.stage_sum, what="expert counts")

    def stage_routing(self) -> StageRouting | None:
        """The monitor's exchange with rank 0 on the ranks of rank 0's pipeline (``pp > 1``): every MoE layer's
        row, a ``reduce`` (sum) to rank 0 over the pipeline group; ``None`` elsewhere."""
        lm = self.layout_mesh
        if self.runner is None or lm.data_rank != 0:
            return None
        from moetrain.moe.layer import MoEAux
        from moetrain.train.monitor import StageRouting
        from moetrain.train.routing_stats import find_loss_fields

        group, main = lm.pp_group, self.is_main

        def reduce(rows: torch.Tensor) -> torch.Tensor | None:
            with named_collective("reduce (routing statistics of the pipeline stages, to rank 0)", group):
                dist.reduce(rows, dst=0, op=dist.ReduceOp.SUM, group=group)
            return rows if main else None

        model = self.runner.config
        return StageRouting(layer_ids=list(model.moe_layer_indices), num_experts=model.moe.num_experts,
                            top_k=model.moe.top_k, expert_bias=model.moe.router.expert_bias,
                            loss_names=find_loss_fields(MoEAux), main=main, reduce=reduce)

    def step_kwargs(self) -> dict[str, Any]:
        return {"count_reducer": self.count_reducer, "sync_grads": self.sync_grads, "reduce_mean": self.reduce_mean,
                "grad_sync": self.grad_sync}

    def grad_sync(self, last: bool) -> None:
        """Before each micro-batch of a step: plain data parallelism all-reduces the gradients in the last
        micro-batch's backward only (``replicate``'s ``set_requires_gradient_sync``, DDP's ``no_sync``; the earlier
        ones accumulate locally), so a step costs one reduction whatever ``train.grad_accum``. Sharded layouts keep
        reducing every micro-batch: an unreduced gradient would be the whole, unsharded one."""
        if self.replicas_only:
            assert self.model is not None, "grad_sync before prepare_model"
            cast(DDP, self.model).set_requires_gradient_sync(last)

    def sync_grads(self, max_norm: float) -> torch.Tensor:
        """FSDP2 reduced the gradients during backward; clip them by the global norm and return it."""
        self._steps += 1
        assert self.model is not None, "sync_grads before prepare_model"
        return clip_grad_norm(self.model, self.layout_mesh, max_norm)

    def reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over the data-parallel ranks of this stage of this rank's losses (1-D)."""
        return self.layout_mesh.stage_sum(values.clone(), "step losses") / self.layout_mesh.layout.data_parallel

    @property
    def layout(self) -> ShardLayout:
        """This rank's checkpoint layout, its experts on the ``(ep, dp_shard)`` mesh, for the ``Checkpointer``."""
        return ShardLayout(self.mesh, self.plan, self.layout_mesh.expert_global_mesh)

    def train_step(self, model: nn.Module, next_batch: Callable[[], Batch], optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, config: TrainConfig, device: torch.device
                   ) -> StepResult:
        """One optimizer step: the pipeline schedule with pp > 1, else ``train_step`` with these hooks."""
        if self.runner is None:
            with named_collective("FSDP2 all-gather / reduce-scatter (forward and backward of the step)",
                                  self.layout_mesh.stage_group, step=True):
                return super().train_step(model, next_batch, optimizer, scheduler, config, device)
        with named_collective("pipeline step (stage send / recv of activations and gradients, FSDP2 all-gather / "
                              "reduce-scatter)", self.layout_mesh.pp_group, step=True):
            # Pipelining takes fixed-shape (inputs, targets) micro-batches (packed documents are refused with
            # several ranks by the trainer).
            windows = cast(Callable[[], tuple[torch.Tensor, torch.Tensor]], next_batch)
            return self.runner.train_step(windows, optimizer, scheduler, config,
                                          self.reduce_mean if self.layout_mesh.layout.data_parallel > 1 else None,
                                          self.count_reducer)

    def evaluate(self, model: nn.Module, batches: Iterable[Batch], device: torch.device, dtype: str) -> float:
        """Validation loss: through the pipeline with pp > 1, else the model's own forward."""
        if self.runner is None:
            with named_collective("FSDP2 all-gather (evaluation forward)", self.layout_mesh.stage_group, step=True):
                return super().evaluate(model, batches, device, dtype)
        with named_collective("pipeline evaluation (stage send / recv)", self.layout_mesh.pp_group, step=True):
            return self.runner.evaluate(cast(Iterable[tuple[torch.Tensor, torch.Tensor]], batches))
