"""Per-rank memory of a layout, before anything is allocated: parameters, gradients, AdamW state, the parameters
FSDP2 gathers, and activations, for each pipeline rank (the ranks of one stage hold the same).

Legend: P = pp, S = dp_shard, X = ep, M = micro-batches per step (``train.grad_accum``), b = rows per rank and
micro-batch (``train.batch_size / (R * S * X)``), L = sequence length.

What each rank holds (counted from the meta model's shapes, so FSDP2's padding of dim 0 to a multiple of the shards
is included):

- **parameters, gradients** (fp32, 4 bytes each) and **AdamW state** (two fp32 moments, 8 bytes): this rank's
  shards: non-expert tensors over ``S * X``, each expert shard (``E / X`` experts) over ``S`` (on dim 1 when fewer
  experts than shards), as :mod:`moetrain.parallel.fsdp` shards them; plain data parallel (``S * X == 1``, and one process)
  holds every non-expert tensor whole.
- **gathered**: the unsharded copies FSDP2 all-gathers for compute (in the compute dtype: ``train.dtype``) and the
  unsharded gradient of one unit before its reduce-scatter (fp32). ZeRO-3 (``reshard_after_forward``): the final
  norm + LM head (one unit that stays gathered from forward to backward), the block being computed and the one
  prefetched, and one block's gradient. ZeRO-2: every unit of the rank, gathered from forward until backward, and
  one block's gradient. None when nothing is sharded (``S * X == 1``).
- **activations**: what one micro-batch saves for backward (:func:`moetrain.analysis.activations.model_activations`,
  b rows, the rank's blocks), times the micro-batches in flight: 1 without a pipeline; with one, 1F1B-type schedules
  hold ``min(M, P - p)`` on pipeline rank p (``P`` per virtual stage for interleaved / V schedules), GPipe all M.

Not counted: the interpreter, libraries, the data set and the allocator's slack (a measured peak therefore reads
against the memory a process had before building its model: benchmarks/memory_by_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moetrain.parallel.layout import Layout
from moetrain.parallel.pipeline import rank_stages

if TYPE_CHECKING:
    from torch import nn

    from moetrain.config import Config

PARAM_BYTES, GRAD_BYTES, ADAMW_BYTES = 4, 4, 8  # fp32 weight, fp32 gradient, AdamW's two fp32 moments


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of pipeline rank ``pp_rank`` holds at its peak (see the module docstring)."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float

    @property
    def state(self) -> float:
        """Parameters + gradients + AdamW state (what sharding divides)."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.gathered + self.activations

    def line(self, ranks: str) -> str:
        mb = 1e6
        return (f"  {ranks}: parameters {self.params / mb:.1f} MB, gradients {self.grads / mb:.1f} MB, AdamW state "
                f"{self.optimizer / mb:.1f} MB, gathered {self.gathered / mb:.1f} MB, activations "
                f"{self.activations / mb:.1f} MB; peak {self.total / mb:.1f} MB")


def _ceil_rows(shape: tuple[int, ...], shards: int) -> int:
    """Elements of the largest FSDP2 shard of a tensor of ``shape`` over ``shards`` ranks (dim 0, padded)."""
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-shape[0] // shards) * rest if len(shape) else 1


def _unit(name: str) -> str:
    """The FSDP2 unit a parameter belongs to: ``blocks.<i>``, ``embed`` or ``tail`` (final norm + LM head)."""
    if name.startswith("blocks."):
        return ".".join(name.split(".")[:2])
    return "embed" if name.startswith("embed_tokens.") else "tail"


def stage_elements(model: nn.Module, config: Config, layout: Layout, stages: list[range]
                   ) -> list[tuple[int, dict[str, int]]]:
    """Per pipeline stage: this rank's sharded parameter elements, and each FSDP2 unit's unsharded elements on
    this rank (experts: its ``E / X`` only)."""
    dense_shards = layout.dp_shard * layout.ep
    out = []
    for i, blocks in enumerate(stages):
        names = {f"blocks.{b}." for b in blocks}
        sharded, full = 0, dict[str, int]()
        for name, p in model.named_parameters():
            first = i == 0 and name.startswith("embed_tokens.")
            last = i == len(stages) - 1 and name.startswith(("norm.", "lm_head."))
            if not (first or last or any(name.startswith(n) for n in names)):
                continue
            shape = tuple(p.shape)
            if ".experts." in name:  # E / ep experts, sharded over dp_shard (on dim 1 when fewer: fsdp.py)
                local = shape[0] // layout.ep
                local_shape = (local, *shape[1:])
                if local >= layout.dp_shard:
                    sharded += _ceil_rows(local_shape, layout.dp_shard)
                else:
                    sharded += local * _ceil_rows(shape[1:], layout.dp_shard)
            else:
                local_shape = shape
                sharded += _ceil_rows(shape, dense_shards)
            n = 1
            for d in local_shape:
                n *= d
            full[_unit(name)] = full.get(_unit(name), 0) + n
        out.append((sharded, full))
    return out


def in_flight(config: Config, pp_rank: int) -> int:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at once (1 without a pipeline)."""
    p, m = config.parallel, config.train.grad_accum
    if p.pp == 1:
        return 1
    if p.pp_schedule == "gpipe":
        return m
    return min(m, p.pp * p.pp_stages_per_rank - pp_rank)


def rank_memory(config: Config, world: int, model: nn.Module | None = None) -> list[RankMemory]:
    """One :class:`RankMemory` per pipeline rank of ``config`` on ``world`` ranks (``model``: the meta model, built
    here when not given).

    Raises:
        ConfigError: an impossible layout (:func:`moetrain.parallel.dry_run.check`).
    """
    from moetrain.analysis.activations import model_activations
    from moetrain.analysis.shape import ModelShape
    from moetrain.parallel.dry_run import check
    from moetrain.parallel.meta_init import build_meta

    layout, stages = check(config, world)
    model = build_meta(config.model) if model is None else model
    p, m, t = config.parallel, config.model, config.train
    per_stage = stage_elements(model, config, layout, stages)
    sharded_path = layout.dp_shard * layout.ep > 1
    compute_bytes = 2 if t.dtype == "bf16" else 4
    shape = ModelShape.from_config(m)
    rows = t.batch_size // layout.data_parallel
    out = []
    for pp_rank in range(layout.pp):
        mine = rank_stages(pp_rank, layout.pp, p.pp_stages_per_rank, p.pp_schedule)
        elems = sum(per_stage[s][0] for s in mine)
        units: dict[str, int] = {}
        for s in mine:
            units.update(per_stage[s][1])
        blocks = [n for k, n in units.items() if k.startswith("blocks.")]
        biggest = max(blocks, default=0)
        if not sharded_path:
            gathered = 0.0
        elif p.reshard_after_forward:  # ZeRO-3: tail, the block computed and the one prefetched, one gradient
            gathered = (units.get("tail", 0) + 2 * max(biggest, units.get("embed", 0))) * compute_bytes \
                + biggest * GRAD_BYTES
        else:  # ZeRO-2: every unit gathered from forward to backward, one gradient
            gathered = sum(units.values()) * compute_bytes + biggest * GRAD_BYTES
        flags = [m.is_moe_layer(b) for s in mine for b in stages[s]]
        last = any(s == len(stages) - 1 for s in mine)
        act = model_activations(shape, flags, rows, config.data.seq_len, m.execution.bta_tiles,
                                p.activation_checkpoint == "full", compute_bytes, lm_head=last, fused_loss=True,
                                ep=layout.ep).peak
        out.append(RankMemory(pp_rank, elems * PARAM_BYTES, elems * GRAD_BYTES, elems * ADAMW_BYTES, gathered,
                              act * in_flight(config, pp_rank)))
    return out


def memory_lines(config: Config, world: int, model: nn.Module | None = None) -> list[str]:
    """``--dry-run``'s and ``plan``'s per-rank lines: a header and one line per pipeline rank."""
    layout = Layout.from_config(config.parallel, world)
    per = layout.world // layout.pp
    lines = ["per-rank memory (fp32 state; model: moetrain.parallel.memory):"]
    for r in rank_memory(config, world, model):
        first = r.pp_rank * per
        ranks = f"rank {first}" if per == 1 else f"ranks {first}-{first + per - 1}"
        lines.append(r.line(ranks + (f" (pipeline rank {r.pp_rank})" if layout.pp > 1 else "")))
    return lines
