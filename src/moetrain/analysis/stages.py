"""Pipeline stages balanced by cost: each block's FLOPs from the cost model, the embedding on the first stage and
the final norm + LM head (and the loss) on the last, split into contiguous stages that minimise the slowest one.

Legend: L = blocks, N = stages, S = sequence length, D = hidden, V = vocabulary.

Cost of a part = its FLOPs per token of one training micro-batch (forward + backward + recomputation:
:func:`moetrain.analysis.flops.step_flops` at batch 1; the attention scores' S^2 makes the split depend on S); the
embedding is a gather (no FLOPs). Hardware-free, so that every rank, the dry run and the planner compute the same
split. The placement (as torchtitan's and Megatron-Core's), what is not modelled and a worked example:
docs/scale-out.md, "Pipeline parallelism".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from moetrain.analysis.flops import step_flops
from moetrain.analysis.shape import ModelShape

RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class StageCosts:
    """Costs of the pipeline's parts, FLOPs per token of one training micro-batch.

    Attributes:
        blocks: [L] cost of each block.
        embedding: cost the first stage adds (the embedding).
        head: cost the last stage adds (final norm, LM head, loss).
    """

    blocks: list[float]
    embedding: float
    head: float


def stage_costs(shape: ModelShape, moe_flags: Sequence[bool], seq: int, bta_tiles: int = 1,
                recompute: str = "none") -> StageCosts:
    """Per-block, embedding and head costs (see the module docstring).

    Args:
        shape: the model's dimensions.
        moe_flags: [L] whether each block is an MoE block (``ModelConfig.is_moe_layer``).
        seq: S, tokens per sequence.
        bta_tiles: G; G > 1 recomputes the attention forward in backward.
        recompute: activation checkpointing: ``none``, ``full`` (each block's forward again) or ``selective``
            (the attention forward, unless BTA already recomputes it, and the routed experts' forward).
    Raises:
        ValueError: ``len(moe_flags) != L``, an MoE / dense count that differs from ``shape``'s, or an unknown
            ``recompute``.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute: {recompute!r} is not one of {RECOMPUTE}")
    n_moe = sum(bool(f) for f in moe_flags)
    if len(moe_flags) != shape.n_layers or n_moe != shape.moe_layers:
        raise ValueError(f"moe_flags: {len(moe_flags)} blocks with {n_moe} MoE ones, but the shape has "
                         f"{shape.n_layers} with {shape.moe_layers}")
    parts = step_flops(shape, 1, seq, bta_tiles, checkpoint=recompute == "full")
    total = {name: p.total for name, p in parts.items()}
    if recompute == "selective":
        for name in ("experts",) + (("attn_proj", "attn_scores") if bta_tiles == 1 else ()):
            total[name] += parts[name].forward
    attention = (total["attn_proj"] + total["attn_scores"]) / shape.n_layers
    moe = sum(total[p] for p in ("router", "experts", "shared_experts")) / max(shape.moe_layers, 1)
    dense = total["dense_ffn"] / max(shape.dense_layers, 1)
    blocks = [(attention + (moe if f else dense)) / seq for f in moe_flags]
    return StageCosts(blocks=blocks, embedding=0.0, head=total["lm_head"] / seq)


def balanced_split(costs: Sequence[float], stages: int, first: float = 0.0, last: float = 0.0) -> list[range]:
    """Contiguous stages of at least one block each, covering ``range(len(costs))``, that minimise the largest
    stage cost (``first`` added to stage 0, ``last`` to the last stage); among those, the smallest sum of squared
    stage costs (the most even memory and work), ties to the earliest cut.

    Exact: a dynamic programme over contiguous partitions, O(N L^2), twice (the bottleneck, then the sum of
    squares among partitions within it).

    Args:
        costs: [L] non-negative cost of each block.
        stages: N, 1 <= N <= L.
        first: cost the first stage holds besides its blocks (the embedding).
        last: cost the last stage holds besides its blocks (final norm, LM head, loss).
    Returns:
        N ranges of block indices, in order.
    Raises:
        ValueError: N outside [1, L].
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"stages: {stages} stages of at least one block need 1 <= stages <= {n} blocks")
    prefix = [0.0, *itertools.accumulate(costs)]

    def cost(j: int, i: int) -> float:
        return prefix[i] - prefix[j] + (first if j == 0 else 0.0) + (last if i == n else 0.0)

    def best(score: str, bound: float) -> tuple[float, list[list[int]]]:
        # table[k][i]: best score of blocks [0, i) in k stages; cut[k][i]: where its last stage starts.
        table = [[math.inf] * (n + 1) for _ in range(stages + 1)]
        cut = [[0] * (n + 1) for _ in range(stages + 1)]
        table[0][0] = 0.0
        for k in range(1, stages + 1):
            for i in range(k, n - (stages - k) + 1):
                for j in range(k - 1, i):
                    c = cost(j, i)
                    if table[k - 1][j] == math.inf or c > bound:
                        continue
                    value = max(table[k - 1][j], c) if score == "max" else table[k - 1][j] + c * c
                    if value < table[k][i]:
                        table[k][i], cut[k][i] = value, j
        return table[stages][n], cut

    bottleneck, _ = best("max", math.inf)
    _, cut = best("squares", bottleneck)  # the same cost() values: the bound is met exactly, no tolerance
    out, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        out.append(range(j, i))
        i = j
    return out[::-1]


def split_stages(shape: ModelShape, moe_flags: Sequence[bool], stages: int, seq: int, bta_tiles: int = 1,
                 recompute: str = "none") -> list[range]:
    """The blocks of each of ``stages`` pipeline stages, balanced by :func:`stage_costs` (what the trainer, the
    dry run and the planner use).

    Raises:
        ValueError: see :func:`stage_costs` and :func:`balanced_split`.
    """
    c = stage_costs(shape, moe_flags, seq, bta_tiles, recompute)
    return balanced_split(c.blocks, stages, c.embedding, c.head)
