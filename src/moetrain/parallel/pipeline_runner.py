"""Runs one optimizer step of a pipeline-parallel job: the routing pre-pass, the ``torch.distributed.pipelining``
schedule over the step's micro-batches, then clipping, AdamW and the expert-bias update, reporting what
:func:`moetrain.train.step.train_step` reports for one process (why that equals one process, tested in
tests/test_pipeline_train.py: docs/scale-out.md, Pipeline parallelism).

Legend: M = micro-batches per step (``train.grad_accum``), b = rows per rank and micro-batch, S = sequence,
D = hidden, E = experts, L_s = MoE layers of this rank's stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.pipelining.stage import _PipelineStageBase

from moetrain.errors import ConfigError
from moetrain.model.config import ModelConfig
from moetrain.moe.layer import MoEAux
from moetrain.parallel.comm import CommStats, named_collective
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.dcp import ShardLayout
from moetrain.parallel.fsdp import apply_fsdp, clip_grad_norm
from moetrain.parallel.launch import parallelize
from moetrain.parallel.layout import ExpertShard, LayoutMesh
from moetrain.parallel.pipeline import StageModule, rank_stages, stage_blocks, stage_rank
from moetrain.model.fused_ce import IGNORE_INDEX
from moetrain.model.transformer import MOE_LOSS_TERMS
from moetrain.train.config import TrainConfig
from moetrain.train.step import Accumulated, StepResult, finish_step

if TYPE_CHECKING:
    from moetrain.model.transformer import MoETransformer

SCHEDULES: dict[str, type[PipelineScheduleSingle] | type[PipelineScheduleMulti]] = {
    "1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
MOE_TERMS = (*MOE_LOSS_TERMS, "moe_loss")  # what StepResult.moe_losses holds


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of [b, S, V] logits against [b, S] targets (-100 ignored), in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def check_microbatches(parallel: ParallelConfig, grad_accum: int) -> None:
    """Raise :class:`ConfigError` unless a step has enough micro-batches for the schedule: every schedule but
    GPipe needs at least one per stage (``torch.distributed.pipelining``), and fewer would leave stages idle anyway
    (the bubble is (stages - 1) / micro-batches of the step)."""
    stages = parallel.pp * parallel.pp_stages_per_rank
    if parallel.pp > 1 and parallel.pp_schedule != "gpipe" and grad_accum < stages:
        raise ConfigError(f"train.grad_accum: {grad_accum} micro-batches per step are fewer than the {stages} "
                          f"pipeline stages (parallel.pp x pp_stages_per_rank) that parallel.pp_schedule="
                          f"'{parallel.pp_schedule}' needs; use train.grad_accum >= {stages} (the micro-batches "
                          "of a pipeline step)")


class LocalModel(nn.Module):
    """The parts of the model this rank's stages hold, under the whole model's names (``embed_tokens``,
    ``blocks.<global index>``, ``norm``, ``lm_head``; absent parts are ``None``): what the optimizer, gradient
    clipping and checkpoints see. Shares the stage modules' submodules; has no forward (the schedule runs the
    stages)."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.config = stages[0].config
        self.embed_tokens = next((m.embed_tokens for m in stages if m.first), None)
        self.blocks = nn.ModuleDict({k: b for m in stages for k, b in m.blocks.items()})
        self.norm = next((m.norm for m in stages if m.last), None)
        self.lm_head = next((m.lm_head for m in stages if m.last), None)


class PipelineRunner:
    """This rank's pipeline stages and schedule.

    Args:
        model: the whole ``MoETransformer`` (on the meta device for a large model: only this rank's shards of its
            stages are materialised), not yet sharded.
        mesh: this rank's :class:`LayoutMesh` (``pp > 1``).
        parallel: ``parallel`` config (schedule, stages per rank, FSDP2 and checkpointing options).
        grad_accum: M, micro-batches per step.
        dtype: ``train.dtype``.
        seed: ``train.seed``.
        stats: communication counters for the EP dispatchers.
        micro_shape: (b, S) of this rank's micro-batches: the stages' input and output shapes are then given to
            ``PipelineStage`` (static metadata) instead of inferred by an extra forward in the first step (which
            would also reach forward hooks: the routing monitor, the exchange counters).
    """

    def __init__(self, model: "MoETransformer", mesh: LayoutMesh, parallel: ParallelConfig, grad_accum: int,
                 dtype: str = "fp32", seed: int = 0, stats: CommStats | None = None,
                 micro_shape: tuple[int, int] | None = None):
        self.mesh, self.m, self.dtype = mesh, grad_accum, dtype
        self.n_stages = mesh.layout.pp * parallel.pp_stages_per_rank
        check_microbatches(parallel, grad_accum)
        self.config: ModelConfig = model.config
        self.schedule_name = parallel.pp_schedule
        self.ranges = stage_blocks(self.config, self.n_stages, micro_shape[1] if micro_shape else None,
                                   parallel.activation_checkpoint)
        self.indices = rank_stages(mesh.pp_rank, mesh.layout.pp, parallel.pp_stages_per_rank, parallel.pp_schedule)
        self.modules = [StageModule(model, self.ranges[i], i == 0, i == self.n_stages - 1) for i in self.indices]
        self.plan: dict[str, ExpertShard] = {}
        for module in self.modules:
            plan = parallelize(module, mesh.ep_mesh, parallel.dispatcher, stats, parallel.activation_checkpoint)
            apply_fsdp(module, mesh, parallel, dtype, seed, plan)
            self.plan.update(plan)
        self.local = LocalModel(self.modules)  # this rank's parameters under the model's names
        self.stages = [PipelineStage(m, i, self.n_stages, mesh.device, group=mesh.pp_group,
                                     **self._metadata(m, micro_shape))
                       for m, i in zip(self.modules, self.indices)]
        self.schedule: PipelineScheduleSingle | PipelineScheduleMulti
        kind = SCHEDULES[parallel.pp_schedule]
        if issubclass(kind, PipelineScheduleMulti):
            stages: list[_PipelineStageBase] = list(self.stages)
            self.schedule = kind(stages, n_microbatches=grad_accum, loss_fn=lm_loss)
        else:
            self.schedule = kind(self.stages[0], n_microbatches=grad_accum, loss_fn=lm_loss)
        self.global_aux = self.config.moe.losses.global_aux_loss_coeff > 0

    def _metadata(self, module: StageModule, micro_shape: tuple[int, int] | None) -> dict[str, Any]:
        """``input_args`` / ``output_args`` examples of a stage for micro-batches of ``micro_shape`` (meta
        tensors: shapes and dtypes only); ``{}`` without a shape (the stage infers them)."""
        if micro_shape is None:
            return {}
        b, seq = micro_shape
        cfg = self.config
        act = torch.bfloat16 if self.dtype == "bf16" else torch.float32  # FSDP2's bf16 parameters compute in bf16
        hidden = torch.empty(b, seq, cfg.hidden, dtype=act, device="meta")
        # A received activation requires grad: that is what makes the stage compute the gradient it sends back.
        inputs = (torch.empty(b, seq, dtype=torch.long, device="meta") if module.first
                  else torch.empty(b, seq, cfg.hidden, dtype=act, device="meta", requires_grad=True))
        outputs = torch.empty(b, seq, cfg.vocab_size, dtype=act, device="meta") if module.last else hidden
        meta = {"input_args": (inputs,), "output_args": (outputs,)}
        if not module.last:  # the gradient a stage receives from the next one
            meta["output_grads"] = (outputs,)
        if not module.first:  # the gradient it sends to the previous one
            meta["input_grads"] = (inputs,)
        return meta

    @property
    def layout(self) -> ShardLayout:
        """The checkpoint layout of this rank's stages."""
        return ShardLayout(self.mesh.ep_mesh, self.plan, self.mesh.expert_global_mesh)

    def holder(self, stage: int) -> int:
        """Global rank holding pipeline stage ``stage`` in this rank's pipeline."""
        return self.mesh.pp_ranks[stage_rank(stage, self.mesh.layout.pp, self.schedule_name)]

    @torch.no_grad()
    def _chain(self, inputs: list[torch.Tensor], what: str) -> dict[int, list[tuple[torch.Tensor, list[MoEAux]]]]:
        """A no-grad forward of ``inputs`` ([b, S] token ids each) through every stage, stage by stage, the hidden
        states [b, S, D] passed point-to-point (sent with ``isend``, so no rank waits on a send while its peer
        waits on another). Returns, per local stage, one (output, MoE records) per input: the trunk's hidden
        states, or on the last stage the logits [b, S, V] when ``what`` is ``"logits"``."""
        carried: list[torch.Tensor] = list(inputs)
        pending: list[Any] = []
        out: dict[int, list[tuple[torch.Tensor, list[MoEAux]]]] = {}
        hidden = self.config.hidden
        group = self.mesh.pp_group
        for i, module in zip(self.indices, self.modules):  # stage order: rank_stages lists them ascending
            if i > 0 and self.holder(i - 1) != self.mesh.rank:
                carried = []
                for x in inputs:
                    buf = torch.empty(*x.shape, hidden, device=self.mesh.device)
                    with named_collective(f"recv (pipeline {what} pass, stage {i} from rank "
                                          f"{self.holder(i - 1)})", group):
                        dist.recv(buf, src=self.holder(i - 1), group=group)
                    carried.append(buf)
            results = []
            for x in carried:
                h, records = module.trunk(x)
                if module.last and what == "logits":
                    h = module.head(h)
                results.append((h, records))
            out[i] = results
            outs = [h.float().contiguous() for h, _ in results]
            if i + 1 < self.n_stages:
                if self.holder(i + 1) != self.mesh.rank:
                    pending += [dist.isend(h, dst=self.holder(i + 1), group=group) for h in outs]
                else:
                    carried = outs
        with named_collective(f"isend (pipeline {what} pass)", group):
            for work in pending:
                work.wait()
        return out

    def route_counts(self, inputs: list[torch.Tensor]) -> None:
        """The routing pre-pass: set every local stage's ``step_counts`` to its MoE layers' counts over the step's
        M micro-batches ``inputs`` ([b, S] each) and all data-parallel ranks of the stage (an all-reduce)."""
        passes = self._chain(inputs, "routing")
        for i, module in zip(self.indices, self.modules):
            counts = [torch.stack([r.tokens_per_expert for r in records]) for _, records in passes[i] if records]
            module.step_counts = (self.mesh.stage_sum(sum(counts[1:], counts[0]), "pipeline expert counts")
                                  if counts else None)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean LM loss (nats/token) over ``batches`` of (inputs, targets) [B, S], every rank of the pipeline
        taking the whole batches (as one process does); the stages are left in train mode."""
        for m in self.modules:
            m.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.mesh.device)  # loss sum, tokens
        try:
            for inputs, targets in batches:
                outs = self._chain([inputs.to(self.mesh.device)], "logits")
                if self.n_stages - 1 in outs:
                    logits = outs[self.n_stages - 1][0][0]
                    n = targets.numel()
                    total[0] += float(lm_loss(logits, targets.to(self.mesh.device))) * n
                    total[1] += n
        finally:
            for m in self.modules:
                m.train()
        with named_collective("all_reduce (pipeline validation loss)", self.mesh.pp_group):
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.mesh.pp_group)
        return float(total[0] / total[1].clamp(min=1))

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Accumulated:
        """Run the schedule over this rank's rows of the step's M micro-batches (inputs, targets [b, S]); the
        gradients accumulate in the stages' parameters. Losses are reduced over the pipeline (every rank returns
        the same values for its data-parallel slice); counts are this rank's stages' [L_s, E]."""
        device = self.mesh.device
        inputs = [x.to(device) for x, _ in batches]
        targets = [y.to(device) for _, y in batches]
        for module in self.modules:
            module.records, module.step_counts = [], None
        if self.global_aux:
            self.route_counts(inputs)
        first, last = 0 in self.indices, self.n_stages - 1 in self.indices
        losses: list[torch.Tensor] = []
        args = (torch.cat(inputs),) if first else ()
        self.schedule.step(*args, target=torch.cat(targets) if last else None, losses=losses if last else None,
                           return_outputs=False)
        for module in self.modules:  # without static shapes the first step adds a shape-inference forward first
            module.records = module.records[-self.m:]
        zero = torch.zeros((), device=device)
        names = [n for n in MOE_TERMS if n != "pooled_aux_loss"]  # the pooled loss is refused with pp > 1
        values = torch.stack([sum(losses, zero).detach() / self.m if last else zero] + [
            sum((r[name] for m in self.modules for r in m.records), zero) / self.m for name in names])
        with named_collective("all_reduce (pipeline step losses)", self.mesh.pp_group):
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.mesh.pp_group)
        moe = {**dict(zip(names, values[1:])), "pooled_aux_loss": zero}
        e = self.config.moe.num_experts
        counts = [torch.stack([r["counts"] for r in m.records]).sum(0) for m in self.modules if m.records]
        tpe = torch.cat(counts) if counts else torch.zeros(0, e, device=device)
        steps = [m.step_counts for m in self.modules if m.step_counts is not None]
        return Accumulated(lm_loss=values[0], moe_losses={k: moe[k] for k in MOE_TERMS}, tokens_per_expert=tpe,
                           global_counts=torch.cat(steps) if steps else None)

    @property
    def tied(self) -> nn.Parameter | None:
        """This rank's share of a tied embedding: the first stage's embedding or the last stage's LM head copy
        (``None`` untied or on a middle rank; a tied model never puts both ends on one rank)."""
        ends = [m.embed_tokens if m.first else m.lm_head for m in self.modules if m.first or m.last]
        if not self.config.tie_embeddings or not ends or ends[0] is None:
            return None
        return cast(nn.Parameter, ends[0].weight)

    @torch.no_grad()
    def sum_tied_grads(self) -> None:
        """Sum a tied embedding's gradient over its two copies (an all-reduce between the first and the last rank
        of the pipeline, Megatron-Core's ``_allreduce_embedding_grads``): what one process's shared weight gets.
        Both copies are FSDP2-sharded alike (same shape and mesh sizes), so the local shards line up."""
        p, group = self.tied, self.mesh.embed_group
        if p is None or group is None:
            return
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        with named_collective("all_reduce (tied embedding gradient, first and last pipeline stage)", group):
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)

    def train_step(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                   optimizer: torch.optim.Optimizer, scheduler: Any, config: TrainConfig,
                   reduce_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   count_reducer: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StepResult:
        """One optimizer step, as :func:`moetrain.train.step.train_step` (same skip rule for non-finite values).

        Args:
            next_batch: returns this rank's rows (inputs, targets [b, S]) of the next micro-batch.
            reduce_mean: mean of losses over the stage's data-parallel ranks (``None`` when there is one).
            count_reducer: sum of [L_s, E] counts over the stage's data-parallel ranks (``None`` when there is one).
        """
        acc = self.forward_backward([next_batch() for _ in range(self.m)])

        def clip(max_norm: float) -> torch.Tensor:
            self.sum_tied_grads()  # a tied embedding's last-stage copy is left out of the norm: the first counts it
            copy = self.tied if any(m.last for m in self.modules) else None
            return clip_grad_norm(self.local, self.mesh, max_norm, copy)

        layers = [layer for m in self.modules for layer in m.moe_layers()]
        return finish_step(acc, layers, optimizer, scheduler, config, clip, count_reducer, reduce_mean)
