"""Pipeline parallelism: the block stack split into stages (``parallel.pp`` ranks x ``pp_stages_per_rank``
virtual stages), scheduled by ``torch.distributed.pipelining``; placement, balancing and the MoE losses' path are in
docs/scale-out.md (Pipeline parallelism), after torchtitan's ``torchtitan/distributed/pipeline_parallel.py``.

Legend: L = blocks, P = pp ranks, V = stages per rank, N = P * V stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from moetrain.analysis.shape import ModelShape
from moetrain.analysis.stages import split_stages
from moetrain.errors import ConfigError
from moetrain.model.block import Block
from moetrain.model.config import ModelConfig
from moetrain.model.transformer import MOE_LOSS_TERMS
from moetrain.moe.layer import MoEAux, MoELayer
from moetrain.moe.losses import global_load_balancing_loss
from moetrain.parallel.ac import blocks

if TYPE_CHECKING:
    from moetrain.model.transformer import MoETransformer


V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed in a V


def stage_blocks(config: ModelConfig, stages: int, seq: int | None = None, recompute: str = "none") -> list[range]:
    """The blocks of each of ``stages`` pipeline stages: contiguous ranges covering ``range(model.n_layers)``, at
    least one block each, that minimise the slowest stage's cost (per-block FLOPs of the cost model, the LM head's
    on the last stage: :func:`moetrain.analysis.stages.split_stages`). Every rank, the dry run and the planner
    compute the same split from the config alone.

    Args:
        config: the model.
        stages: N = ``parallel.pp`` x ``pp_stages_per_rank``.
        seq: tokens per sequence (``data.seq_len``; the attention's share grows with it); default
            ``model.max_seq_len``.
        recompute: ``parallel.activation_checkpoint`` (recomputed blocks cost more, the LM head does not).
    Raises:
        ConfigError: more stages than blocks (``parallel.pp`` x ``pp_stages_per_rank`` > ``model.n_layers``).
    """
    n_layers = config.n_layers
    if stages < 1 or stages > n_layers:
        raise ConfigError(f"parallel.pp: {stages} pipeline stages (pp x pp_stages_per_rank) need at least one block "
                          f"each, but model.n_layers={n_layers}")
    flags = [config.is_moe_layer(i) for i in range(n_layers)]
    return split_stages(ModelShape.from_config(config), flags, stages, seq or config.max_seq_len,
                        config.execution.bta_tiles, recompute)


def check_losses(config: ModelConfig) -> None:
    """Refuse the MoE losses a pipeline cannot split over its stages (the trainer and ``--dry-run`` both call it).

    Raises:
        ConfigError: ``pooled_aux_loss_coeff > 0`` (pooled over all layers at once).
    """
    if config.moe.losses.pooled_aux_loss_coeff > 0:
        raise ConfigError("model.moe.losses.pooled_aux_loss_coeff: the pooled loss spans all layers at once and "
                          "cannot be split over pipeline stages; use aux_loss_coeff or global_aux_loss_coeff")


def rank_stages(pp_rank: int, pp: int, per_rank: int, schedule: str = "1f1b") -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank``: looped (``pp_rank, pp_rank + P, ...``), or for the
    V-shaped schedules (:data:`V_SCHEDULES`, ``per_rank == 2``) ``[pp_rank, 2P - 1 - pp_rank]``."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(per_rank)]


def stage_rank(stage: int, pp: int, schedule: str = "1f1b") -> int:
    """The pipeline rank holding ``stage`` (the inverse of :func:`rank_stages`)."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


# -- stage modules ---------------------------------------------------------------------------------------------

class _AttachLoss(torch.autograd.Function):
    """An alias of ``h`` in forward; in backward ``h``'s gradient passes through and ``loss`` receives gradient 1
    (Megatron-Core's ``MoEAuxLossAutoScaler``): a stage's MoE losses enter the step's loss as in one process without
    travelling to the last stage. The alias is ``h.detach()`` (no copy), not a view (docs/scale-out.md says why)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return h.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class StageModule(nn.Module):
    """One pipeline stage of an ``MoETransformer``: (embedding) -> its blocks -> (final norm -> LM head), a slice
    of the model run by the model's own forward steps (``embed``, ``run_blocks``, ``logits``), as torchtitan's
    stages are slices of the model. Parameter names equal the whole model's (``blocks`` is a ``ModuleDict`` keyed
    by the global block index). The stage adds its MoE layers' share of ``moe_loss`` through :class:`_AttachLoss`.
    Pipelining fixes a stage's forward signature to the tensors passed between stages, so per step the runner sets
    ``step_counts`` ([L_s, E] global-batch counts from the routing pre-pass) and reads and clears ``records`` (per
    micro-batch forward: the detached loss terms and ``counts`` [L_s, E]). With tied embeddings the
    last stage holds its own copy of the embedding as its LM head (docs/scale-out.md).

    Args:
        model: the whole model (meta or real); its modules are shared, not copied (the tied LM head excepted).
        blocks: the global indices of this stage's blocks.
        first: the stage holds the embedding.
        last: the stage holds the final norm and the LM head.
    Raises:
        ConfigError: ``pooled_aux_loss_coeff > 0`` (pooled over all layers at once: not split over stages).
    """

    model: "MoETransformer"  # the whole model, whose forward steps run the stage (not a submodule)

    def __init__(self, model: "MoETransformer", blocks: range, first: bool, last: bool):
        super().__init__()
        config: ModelConfig = model.config
        check_losses(config)
        self.config = config
        self.first, self.last = first, last
        # A plain attribute, not a submodule: the model's other parts are not the stage's to shard, step or save.
        object.__setattr__(self, "model", model)
        all_blocks = [cast(Block, b) for b in model.blocks]
        self.embed_tokens: nn.Module | None = model.embed_tokens if first else None
        self.blocks = nn.ModuleDict({str(i): all_blocks[i] for i in blocks})
        self.norm: nn.Module | None = model.norm if last else None
        self.lm_head: nn.Module | None = model.lm_head if last else None
        if last and config.tie_embeddings:  # its own copy of the embedding, kept equal by summed gradients
            head = nn.Linear(config.hidden, config.vocab_size, bias=False, device=model.lm_head.weight.device)
            head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
            self.lm_head = head
        self.moe_total = sum(1 for b in all_blocks if b.is_moe)
        self.step_counts: torch.Tensor | None = None
        self.records: list[dict[str, torch.Tensor]] = []

    def moe_layers(self) -> list[MoELayer]:
        return [cast(MoELayer, b.ffn) for b in blocks(self) if b.is_moe]

    def trunk(self, x: torch.Tensor) -> tuple[torch.Tensor, list[MoEAux]]:
        """The model's embedding (first stage: ``x`` [b, S] token ids) and this stage's blocks: ([b, S, D], the
        MoE records)."""
        h = self.model.embed(x) if self.first else x
        return self.model.run_blocks(h, self.blocks.values())

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The model's final norm and LM head (this stage's own copy when tied): [b, S, D] -> [b, S, V] logits."""
        assert self.last, "head() of a stage that is not the last"
        return self.model.logits(h, self.lm_head)

    def moe_terms(self, records: list[MoEAux]) -> dict[str, torch.Tensor]:
        """This stage's share of each MoE loss term (sum over its layers / the model's MoE layers)."""
        zero = torch.zeros((), device=records[0].prob_sum.device) if records else torch.zeros(())
        n = max(self.moe_total, 1)

        def term(r: MoEAux, name: str) -> torch.Tensor:
            value = getattr(r, name, None)  # a layer may report None for a term it does not compute: 0
            return zero if value is None else cast(torch.Tensor, value)

        # Every per-layer term of assemble_moe_losses (a mean over the model's MoE layers).
        out = {name: sum((term(r, name) for r in records), zero) / n
               for name in MOE_LOSS_TERMS if name not in ("pooled_aux_loss", "global_aux_loss")}
        counts = self.step_counts
        if counts is None:
            counts = torch.stack([r.tokens_per_expert for r in records]) if records else zero.new_zeros(0, 0)
        out["global_aux_loss"] = sum((global_load_balancing_loss(r.prob_sum, r.num_tokens, counts[i].to(zero.device))
                                      for i, r in enumerate(records)), zero) / n
        losses = self.config.moe.losses
        out["moe_loss"] = sum((getattr(losses, f"{k}_coeff") * v for k, v in out.items()), zero)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, S] int64 token ids (first stage) or [b, S, D] hidden states -> [b, S, D] hidden states, or
        [b, S, V] logits on the last stage."""
        h, records = self.trunk(x)
        if records and torch.is_grad_enabled():
            terms = self.moe_terms(records)
            summary = {k: v.detach() for k, v in terms.items()}
            summary["counts"] = torch.stack([r.tokens_per_expert for r in records])  # [L_s, E]
            self.records.append(summary)  # detached: keeps no graph alive
            # Before the LM head on the last stage: the copy is then [b, S, D], not [b, S, V] logits.
            h = cast(torch.Tensor, _AttachLoss.apply(h, terms["moe_loss"]))  # type: ignore[no-untyped-call]
        if self.last:
            h = self.head(h)  # [b, S, V]: the fused LM head + loss does not fit pipelining's loss_fn
        return h
