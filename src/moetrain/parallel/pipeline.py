"""Pipeline parallelism: the block stack split into stages (``parallel.pp`` ranks x ``pp_stages_per_rank``
virtual stages), scheduled by ``torch.distributed.pipelining``.

Legend: L = blocks, P = pp ranks, V = stages per rank, N = P * V stages.

Placement follows torchtitan's recipe (``pipeline_parallel.py``): stage 0 also holds the embedding, the last stage
the final norm and LM head; by default the blocks are split evenly (what the planner's memory model assumes:
ceil(L / N) blocks on the busiest stage); ``head_weight > 0`` counts the embedding and the LM head as that many
blocks each and moves blocks off the end stages (torchtitan's ``layers_per_stage`` option does the same). Stage ``i`` lives on rank ``i % P`` (the looped placement of
Interleaved 1F1B).
"""

from __future__ import annotations

import math

from moetrain.errors import ConfigError


def stage_blocks(n_layers: int, stages: int, head_weight: float = 0.0) -> list[range]:
    """The blocks of each of ``stages`` stages: contiguous ranges covering ``range(n_layers)``, balanced by cost
    with the embedding (stage 0) and the LM head (last stage) each costing ``head_weight`` blocks, every stage at
    least one block.

    Raises:
        ConfigError: more stages than blocks (``parallel.pp`` x ``pp_stages_per_rank`` > ``model.n_layers``).
    """
    if stages < 1 or stages > n_layers:
        raise ConfigError(f"parallel.pp: {stages} pipeline stages (pp x pp_stages_per_rank) need at least one block "
                          f"each, but model.n_layers={n_layers}")
    total = n_layers + 2 * head_weight
    out, start = [], 0
    for i in range(stages):
        left = stages - i - 1  # later stages, each needing at least one block
        # Block j ends at cumulative cost head_weight + j + 1; stage i ends where the cost reaches its share.
        stop = n_layers if left == 0 else math.floor(total * (i + 1) / stages - head_weight + 0.5)
        stop = min(max(stop, start + 1), n_layers - left)
        out.append(range(start, stop))
        start = stop
    return out


def rank_stages(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank`` (looped: ``pp_rank, pp_rank + P, ...``)."""
    return [pp_rank + v * pp for v in range(per_rank)]
