"""Parameter counts per model part, and the memory of weights, gradients and AdamW states per device.

Legend: V = vocabulary, D = hidden, L = blocks, E = experts, K = top-k, F = expert FFN hidden.

Bytes per parameter follow moetrain's trainer: fp32 weights (bf16 runs autocast and keep fp32 master weights), fp32
gradients, and AdamW's two fp32 moments (``exp_avg``, ``exp_avg_sq``): 4 + 4 + 8 = 16 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moetrain.analysis.shape import ModelShape


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part (whole model). ``experts`` are the routed experts, everything else is "dense".

    Attributes:
        embedding: the token embedding.
        lm_head: the LM head (0 when tied to the embedding).
        final_norm: the RMSNorm before the LM head.
        norms: the blocks' RMSNorms.
        attention: projections, biases and q/k norms.
        dense_ffn: the FFNs of blocks without MoE.
        router: the routers' weights.
        experts: the routed experts.
        shared_experts: the shared experts, with their gates.
    """

    embedding: int
    lm_head: int
    final_norm: int
    norms: int
    attention: int
    dense_ffn: int
    router: int
    experts: int
    shared_experts: int
    num_experts: int = 1
    top_k: int = 1

    @property
    def total(self) -> int:
        return self.dense + self.experts

    @property
    def dense(self) -> int:
        """Every parameter that is not a routed expert (replicated across expert-parallel ranks)."""
        return (self.embedding + self.lm_head + self.final_norm + self.norms + self.attention + self.dense_ffn
                + self.router + self.shared_experts)

    @property
    def active(self) -> int:
        """Parameters one token uses: all dense ones and K of each layer's E routed experts (the convention of
        ``moetrain.model.transformer.count_parameters``)."""
        return self.total - self.experts * (self.num_experts - self.top_k) // self.num_experts


def count_params(shape: ModelShape) -> ParamCounts:
    """Exact parameter counts of ``MoETransformer`` built from the config ``shape`` was read from."""
    d, q, kv = shape.hidden, shape.q_width, shape.kv_width
    attn = d * q + 2 * d * kv + q * d
    if shape.attention_bias:
        attn += q + 2 * kv
    if shape.qk_norm == "head":
        attn += 2 * shape.head_size
    elif shape.qk_norm == "full":
        attn += q + kv
    shared = 0
    if shape.shared_ffn:
        shared = shape.expert_mats * d * shape.shared_ffn + (d if shape.shared_gate else 0)
    return ParamCounts(
        embedding=shape.vocab * d,
        lm_head=0 if shape.tie_embeddings else shape.vocab * d,
        final_norm=d,
        norms=2 * d * shape.n_layers,
        attention=attn * shape.n_layers,
        dense_ffn=3 * d * shape.dense_ffn * shape.dense_layers,
        router=shape.num_experts * d * shape.moe_layers,
        experts=shape.num_experts * shape.expert_params * shape.moe_layers,
        shared_experts=shared * shape.moe_layers,
        num_experts=shape.num_experts,
        top_k=shape.top_k,
    )


Placement = tuple[int, bool, bool]
"""One pipeline rank's part of the model: (blocks it holds, it holds the embedding, it holds the final norm + LM
head)."""


def placements(stages: Sequence[range], rank_stages: Sequence[Sequence[int]] | None = None) -> list[Placement]:
    """Each pipeline rank's :data:`Placement` for ``stages`` (the blocks of each stage, in order; stage 0 holds the
    embedding, the last stage the LM head); ``rank_stages`` lists the stages of each rank (default: one stage per
    rank, rank i holding stage i)."""
    held = rank_stages if rank_stages is not None else [[i] for i in range(len(stages))]
    last = len(stages) - 1
    return [(sum(len(stages[i]) for i in mine), 0 in mine, last in mine) for mine in held]


def _placed(counts: ParamCounts, n_layers: int, ep: int, place: Placement) -> tuple[float, float]:
    blocks, first, last = place
    per_block = (counts.norms + counts.attention + counts.dense_ffn + counts.router + counts.shared_experts) / n_layers
    ends = (counts.embedding if first else 0) + (counts.lm_head + counts.final_norm if last else 0)
    return per_block * blocks + ends, counts.experts / n_layers * blocks / ep


def local_params(counts: ParamCounts, n_layers: int, ep: int = 1, pp: int = 1,
                 stages: Sequence[Placement] | None = None) -> tuple[float, float]:
    """(dense, routed-expert) parameters on the busiest device: its blocks' share of the block parameters (the
    average block), its pipeline ends, and 1 / ep of its blocks' experts.

    Args:
        stages: each pipeline rank's :data:`Placement` (the trainer's split: :func:`placements` of
            :func:`moetrain.analysis.stages.split_stages`); default ceil(L / pp) blocks with the larger pipeline end
            (embedding, or LM head + final norm; both when pp == 1) on the busiest device.
    """
    return max((_placed(counts, n_layers, ep, s) for s in stages or _even_split(n_layers, pp)), key=sum)


def _even_split(n_layers: int, pp: int) -> list[Placement]:
    """ceil(L / pp) blocks with either pipeline end (both when pp == 1): the busiest of an even split."""
    blocks = -(-n_layers // pp)
    return [(blocks, True, pp == 1), (blocks, pp == 1, True)]


def sharded_params(counts: ParamCounts, n_layers: int, ep: int = 1, pp: int = 1, dp_shard: int = 1,
                   stages: Sequence[Placement] | None = None) -> float:
    """Parameters one device holds under FSDP2 (``moetrain.parallel.fsdp``) on the busiest stage: the dense ones
    sharded over the ``dp_shard * ep`` ranks of a replica, the E / ep local experts over ``dp_shard``; weights,
    gradients and AdamW moments are all sharded the same way (ZeRO-3; ZeRO-2 adds the unsharded weights while a
    block computes, which are activations-time memory, not state). ``stages``: as in :func:`local_params`."""
    placed = (_placed(counts, n_layers, ep, s) for s in stages or _even_split(n_layers, pp))
    return max(d / (dp_shard * ep) + e / dp_shard for d, e in placed)


WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 4, 4, 8  # per parameter: fp32 weight, gradient, AdamW's two moments


@dataclass(frozen=True)
class StateMemory:
    """Per-device bytes of weights, gradients and optimizer states."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def state_memory(counts: ParamCounts, n_layers: int, ep: int = 1, pp: int = 1, dense_replicas: int = 1,
                 expert_replicas: int = 1, zero1: bool = False,
                 stages: Sequence[Placement] | None = None) -> StateMemory:
    """Weights, gradients and optimizer states on the busiest device.

    Args:
        counts: the model's parameters.
        n_layers: L, split into ``pp`` pipeline stages as ``stages`` says (default evenly: ceil(L / pp) blocks on
            the busiest stage, which also holds the embedding or the LM head, whichever is larger).
        ep: expert-parallel degree: each device holds E / ep of a layer's experts.
        pp: pipeline stages.
        dense_replicas: devices holding a copy of the same dense parameters (the data-parallel group size); with
            ``zero1`` the optimizer states are sharded across them (ZeRO stage 1, Megatron's distributed optimizer).
        expert_replicas: the same for the expert parameters.
        stages: each pipeline rank's :data:`Placement` (default: the even split of :func:`local_params`).
    """
    dense, experts = local_params(counts, n_layers, ep, pp, stages)
    params = dense + experts
    opt = dense / dense_replicas + experts / expert_replicas if zero1 else params
    return StateMemory(weights=params * WEIGHT_BYTES, grads=params * GRAD_BYTES, optimizer=opt * OPTIMIZER_BYTES)
