"""Per-rank memory of a layout, before anything is allocated: the peak of what a training step holds on each
pipeline rank (the ranks of one stage hold the same), term by term; docs/scale-out.md (Per-rank memory) explains
the terms, this gives their sources.

Legend: P = pp, S = dp_shard, X = ep, M = micro-batches per step (``train.grad_accum``), b = rows per rank and
micro-batch (``train.batch_size / (R * S * X)``), U = one FSDP2 unit's unsharded bytes on this rank, c = bytes of
the compute dtype (``train.dtype``).

Counted from the meta model's shapes (so FSDP2's padding of dim 0 to a multiple of the shards is included):

- **parameters, gradients** (fp32) and **AdamW state** (two fp32 moments): this rank's shards as
  :mod:`moetrain.parallel.fsdp` makes them; at the peak only the gradients that exist then
  (:attr:`RankMemory.grads_at_peak`).
- **gathered**: FSDP2's unsharded copies (compute dtype), also where a unit has one shard (FSDP2 then copies the
  shard: ``_fsdp_param_group.py`` ``wait_for_unshard``).
- **communication**: the reduce-scatter's flat fp32 input (U), kept until the next unit's reduce-scatter starts
  (``reduce_scatter_max_input_buffers = 1``, ``_fsdp_param_group.py`` ``post_backward``); under ZeRO-3 the next
  unit's prefetched all-gather (U in the compute dtype, ``_fsdp_collectives.py``); on gloo a second U per
  collective (``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` reduces a clone of its input, its all-gather
  writes a flat output first: ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``).
- **activations**: :func:`moetrain.analysis.activations.model_activations` (b rows, the rank's blocks); in a
  pipeline rank's first backward those of the micro-batches in flight (:func:`moetrain.analysis.step.in_flight`).
- **MoE scratch** (CPU): moe/kernels/cpu/workspace.py keeps each buffer at the largest size a call asked for
  (:func:`moe_scratch`).
- **runtime** (CPU): :data:`RUNTIME_CPU_BYTES` per process. On CUDA the measured peak is the caching allocator's
  tensors (``torch.cuda.max_memory_allocated``), so neither this nor the scratch counts there.

The peak is the largest of the moments (:func:`step_moments`): each unit's backward, each unit's reduce-scatter
(copy-in, then the collective), a pipeline rank's first backward and the optimizer step; with ``M > 1`` each
micro-batch's backward adds a fresh gradient of one unit's routed experts (moe/fast_moe.py).

Not counted: the token batches (preflight.py adds them), a checkpoint being written, gloo's all-reduce of
replicated gradients (``dp_replicate``), the allocator's slack, and mapped but barely resident address space such
as the threads' stacks (preflight.py's ``reserved_bytes`` adds them under an address-space limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moetrain.parallel.layout import Layout
from moetrain.parallel.pipeline import rank_stages

if TYPE_CHECKING:
    from torch import nn

    from moetrain.analysis.shape import ModelShape
    from moetrain.config import Config

PARAM_BYTES, GRAD_BYTES, ADAMW_BYTES = 4, 4, 8  # fp32 weight, fp32 gradient, AdamW's two fp32 moments
STATE_BYTES = PARAM_BYTES + GRAD_BYTES + ADAMW_BYTES
# A CPU training process's resident memory grows by this besides its tensors from the model's build to its peak:
# library code pages training touches first, Python modules it imports (rank 0: the metrics writer too), the C heap.
# Measured 2026-12-07 (AMD EPYC, torch 2.13, Python 3.11, glibc with benchmarks/memory_by_layout.py's ALLOCATOR) as
# peak resident memory minus the peak of malloc's mmapped chunks: rank 0 36-41 MB, other ranks 22-28 MB, one
# process 39 MB.
RUNTIME_CPU_BYTES = 40e6


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit (:mod:`moetrain.parallel.fsdp`) as one rank holds it: elements of its parameters unsharded
    (``full``: routed experts only this rank's ``E / X``) and in this rank's shard (``shard``, padded), the most
    routed-expert elements of one of its blocks (``experts``: the gradient one fused MoE backward allocates), and
    whether a collective gathers it (``collective``: its mesh has more than one rank; with one, FSDP2 copies the
    shard)."""

    name: str
    full: int = 0
    shard: int = 0
    experts: int = 0
    collective: bool = False


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of pipeline rank ``pp_rank`` holds (see the module docstring): its sharded state
    (``params``, ``grads``, ``optimizer``) and, at its peak (``moment``), the gradients alive then
    (``grads_at_peak``), the gathered parameters, collective buffers, activations, kept MoE scratch and the
    runtime."""

    pp_rank: int
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    grads_at_peak: float = 0.0
    comm: float = 0.0
    scratch: float = 0.0
    runtime: float = 0.0
    moment: str = "the optimizer step"

    @property
    def state(self) -> float:
        """Parameters + gradients + AdamW state (what sharding divides)."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The peak: every term at the moment ``moment``."""
        return (self.params + self.grads_at_peak + self.optimizer + self.gathered + self.comm + self.activations
                + self.scratch + self.runtime)

    def line(self, ranks: str) -> str:
        mb = 1e6
        return (f"  {ranks}: parameters {self.params / mb:.1f} MB, gradients {self.grads / mb:.1f} MB, AdamW state "
                f"{self.optimizer / mb:.1f} MB; at the peak ({self.moment}): gradients {self.grads_at_peak / mb:.1f} "
                f"MB, gathered {self.gathered / mb:.1f} MB, communication {self.comm / mb:.1f} MB, activations "
                f"{self.activations / mb:.1f} MB, MoE scratch {self.scratch / mb:.1f} MB, runtime "
                f"{self.runtime / mb:.1f} MB; peak {self.total / mb:.1f} MB")


def _ceil_rows(shape: tuple[int, ...], shards: int) -> int:
    """Elements of the largest FSDP2 shard of a tensor of ``shape`` over ``shards`` ranks (dim 0, padded)."""
    return -(-shape[0] // shards) * math.prod(shape[1:]) if len(shape) else 1


def _unit(name: str, layout: Layout) -> str:
    """The FSDP2 unit a parameter belongs to (fsdp.py): ``blocks.<i>``, ``blocks.<i>.experts`` (their own unit
    under expert parallelism), ``embed`` or ``tail`` (final norm + LM head); everything is one ``stage`` unit when
    nothing is sharded (``S * X == 1``)."""
    if layout.dp_shard * layout.ep == 1:
        return "stage"
    if name.startswith("blocks."):
        block = ".".join(name.split(".")[:2])
        return block + ".experts" if layout.ep > 1 and ".experts." in name else block
    return "embed" if name.startswith("embed_tokens.") else "tail"


def stage_elements(model: nn.Module, config: Config, layout: Layout, stages: list[range]
                   ) -> list[tuple[int, list[Unit]]]:
    """Per pipeline stage: this rank's sharded parameter elements, and its FSDP2 units in forward order."""
    dense_shards = layout.dp_shard * layout.ep
    out = []
    for i, blocks in enumerate(stages):
        names = {f"blocks.{b}." for b in blocks}
        sharded, units, experts = 0, dict[str, Unit](), dict[tuple[str, str], int]()
        for name, p in model.named_parameters():
            first = i == 0 and name.startswith("embed_tokens.")
            last = i == len(stages) - 1 and name.startswith(("norm.", "lm_head."))
            if not (first or last or any(name.startswith(n) for n in names)):
                continue
            shape = tuple(p.shape)
            expert = ".experts." in name
            if expert:  # E / ep experts, sharded over dp_shard (on dim 1 when fewer: fsdp.py)
                local = shape[0] // layout.ep
                local_shape = (local, *shape[1:])
                mesh = layout.dp_shard if layout.ep > 1 else dense_shards
                shard = (_ceil_rows(local_shape, mesh) if local >= mesh else local * _ceil_rows(shape[1:], mesh))
            else:
                local_shape, mesh = shape, dense_shards
                shard = _ceil_rows(shape, mesh)
            n = math.prod(local_shape)
            sharded += shard
            key = _unit(name, layout)
            u = units.get(key, Unit(key))
            most = u.experts
            if expert:  # per block: one fused MoE backward allocates its experts' gradient
                block = (key, ".".join(name.split(".")[:2]))
                experts[block] = experts.get(block, 0) + n
                most = max(most, experts[block])
            units[key] = Unit(key, u.full + n, u.shard + shard, most, u.collective or mesh > 1)
        # forward order: embedding, then each block (its experts' unit inside it), the tail
        order = sorted(units.values(), key=lambda u: (u.name != "embed", u.name == "tail",
                                                      int(u.name.split(".")[1]) if u.name.startswith("blocks.")
                                                      else 0, u.name))
        out.append((sharded, order))
    return out


def moe_scratch(shape: ModelShape, train_rows: int, eval_rows: int, seq: int, act_bytes: int, ep: int = 1) -> float:
    """Bytes of the fused MoE path's scratch kept between calls on CPU (module docstring): forward buffers for
    the larger of ``train_rows`` and ``eval_rows`` sequences of ``seq`` tokens, backward ones for ``train_rows``;
    0 where the experts do not run fused. Under expert parallelism a rank computes the rows routed to its
    ``E / X`` experts from all ``X`` ranks: as many as its own tokens route, with balanced routing."""
    if not shape.fused_experts or not shape.num_experts:
        return 0.0
    d, f = shape.hidden, shape.expert_ffn
    i = (2 if shape.expert_mats == 3 else 1) * f  # the pre-activation's width (SwiGLU: gate and up)
    fwd_rows = shape.expert_rows(max(train_rows, eval_rows) * seq)
    bwd_rows = shape.expert_rows(train_rows * seq)
    recompute = i if shape.recompute_experts else 0  # fwd.h / bwd.h when the pre-activation is not saved
    forward = fwd_rows * (2 * d + f + recompute)  # fwd.y, fwd.xs, fwd.a
    backward = bwd_rows * (3 * d + 2 * f + i + recompute)  # bwd.dx, bwd.g, bwd.xs; bwd.dz, bwd.a; bwd.dh
    return float((forward + backward) * act_bytes)


@dataclass
class _Moment:
    """What is alive at one moment of a step, besides the parameters, AdamW state, scratch and runtime."""

    name: str
    grads: float = 0.0
    gathered: float = 0.0
    comm: float = 0.0
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.grads + self.gathered + self.comm + self.activations


def step_moments(units: list[Unit], acts: list[float], transient: float, c: int, zero3: bool, gloo: bool,
                 accumulate: bool, first_acts: float) -> list[_Moment]:
    """The moments of a step on one rank whose FSDP2 units are ``units`` (forward order; ``acts[i]``: unit i's
    saved activations for one micro-batch; ``transient``: a recomputed region's; ``c``: compute-dtype bytes;
    ``zero3``: units resharded after forward; ``gloo``: the collectives copy their buffers;
    ``accumulate``: ``M > 1``; ``first_acts``: the activations the first backward finds, all in-flight
    micro-batches'). Gradients here are fp32 (``GRAD_BYTES``)."""
    g = GRAD_BYTES
    n = len(units)
    moments = [_Moment("the optimizer step", grads=sum(u.shard for u in units) * g)]
    for i in range(n - 1, -1, -1):
        u = units[i]
        reduced = sum(v.shard for v in units[i + 1:]) * g  # sharded gradients of the units already run backward
        pending = sum(v.full for v in units[:i]) * g if accumulate else 0.0  # earlier micro-batches' unsharded
        held = sum(v.full for v in units[:i + 1]) * c  # ZeRO-2 / one unit: gathered from forward until backward
        gathered = u.full * c if zero3 else held
        # ZeRO-3: the next unit's all-gather, prefetched (a one-shard unit is copied at its own backward instead)
        nxt = units[i - 1] if zero3 and i > 0 and units[i - 1].collective else None
        prefetch = nxt.full * c * (2 if gloo else 1) if nxt is not None else 0.0
        kept = units[i + 1].full * g if i + 1 < n else 0.0  # the previous reduce-scatter's flat input
        left = sum(acts[:i + 1]) + transient
        fresh = u.experts * g if accumulate else 0.0  # this micro-batch's expert gradients, added to the pending
        moments.append(_Moment(f"backward of {u.name}", grads=reduced + pending + u.full * g + fresh,
                               gathered=gathered, comm=prefetch + kept, activations=left))
        after = held - u.full * c if not zero3 else 0.0  # resharded before its reduce-scatter
        rest = left - acts[i]
        moments.append(_Moment(f"reduce-scatter copy-in of {u.name}", grads=reduced + pending + u.full * g,
                               gathered=after, comm=u.full * g + prefetch, activations=rest))
        clone = u.full * g if gloo and u.collective else 0.0
        moments.append(_Moment(f"reduce-scatter of {u.name}", grads=reduced + pending + u.shard * g,
                               gathered=after, comm=u.full * g + clone + prefetch, activations=rest))
    if first_acts > sum(acts) and n:  # a pipeline's first backward: in-flight micro-batches, no gradient yet
        last = units[-1]
        held = sum(v.full for v in units) * c
        moments.append(_Moment(f"first backward of {last.name}", grads=last.full * g,
                               gathered=last.full * c if zero3 else held, activations=first_acts + transient))
    return moments


def rank_memory(config: Config, world: int, model: nn.Module | None = None, device: str | None = None
                ) -> list[RankMemory]:
    """One :class:`RankMemory` per pipeline rank of ``config`` on ``world`` ranks (``model``: the meta model, built
    here when not given; ``device``: ``cpu`` or ``cuda``, default ``train.device``, ``auto`` resolved here).

    Raises:
        ConfigError: an impossible layout (:func:`moetrain.parallel.dry_run.check`).
    """
    from moetrain.analysis.activations import model_activations
    from moetrain.analysis.shape import ModelShape
    from moetrain.analysis.step import in_flight
    from moetrain.parallel.dry_run import check
    from moetrain.parallel.meta_init import build_meta

    layout, stages = check(config, world)
    model = build_meta(config.model) if model is None else model
    p, m, t = config.parallel, config.model, config.train
    per_stage = stage_elements(model, config, layout, stages)
    device = device or config.train.device
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    gloo = p.backend == "gloo" or (p.backend == "auto" and cpu)
    compute_bytes = 2 if t.dtype == "bf16" else 4
    shape = ModelShape.from_config(m)
    rows = t.batch_size // layout.data_parallel
    eval_rows = t.batch_size if layout.pp == 1 else rows  # without a pipeline each rank evaluates the whole batch
    scratch = moe_scratch(shape, rows, eval_rows, config.data.seq_len, compute_bytes, layout.ep) if cpu else 0.0
    runtime = RUNTIME_CPU_BYTES if cpu else 0.0
    out = []
    for pp_rank in range(layout.pp):
        mine = rank_stages(pp_rank, layout.pp, p.pp_stages_per_rank, p.pp_schedule)
        elems = sum(per_stage[s][0] for s in mine)
        units = [u for s in mine for u in per_stage[s][1]]
        flags = [m.is_moe_layer(b) for s in mine for b in stages[s]]
        last = any(s == len(stages) - 1 for s in mine)
        act = model_activations(shape, flags, rows, config.data.seq_len, m.execution.bta_tiles,
                                p.activation_checkpoint == "full", compute_bytes, lm_head=last, fused_loss=True,
                                ep=layout.ep)
        state = _Moment("the optimizer step", grads=elems * GRAD_BYTES)
        if world == 1:  # one process, no FSDP2: gradients and activations at the end of backward
            peak = _Moment("the end of backward", grads=elems * GRAD_BYTES, activations=act.peak)
            moments = [state, peak]
        else:
            blocks = iter(act.blocks)
            acts = [next(blocks, 0.0) if u.name.startswith("blocks.") and not u.name.endswith(".experts")
                    else act.other if u.name == "tail" else 0.0 for u in units]
            if len(units) == 1:  # one unit of the whole stage (S * X == 1): every activation in it
                acts = [act.peak - act.transient]
            zero3 = p.reshard_after_forward and len(units) > 1
            flight = in_flight(p.pp, t.grad_accum, pp_rank, p.pp_stages_per_rank, p.pp_schedule)
            moments = step_moments(units, acts, act.transient, compute_bytes, zero3, gloo, t.grad_accum > 1,
                                   (act.peak - act.transient) * flight)
        top = max(moments, key=lambda x: x.total)
        out.append(RankMemory(pp_rank, elems * PARAM_BYTES, elems * GRAD_BYTES, elems * ADAMW_BYTES, top.gathered,
                              top.activations, grads_at_peak=top.grads, comm=top.comm, scratch=scratch,
                              runtime=runtime, moment=top.name))
    return out


def memory_lines(config: Config, world: int, model: nn.Module | None = None, device: str | None = None,
                 ranks: list[RankMemory] | None = None) -> list[str]:
    """``--dry-run``'s and ``plan``'s per-rank lines: a header and one line per pipeline rank (of ``ranks``, by
    default :func:`rank_memory`'s)."""
    layout = Layout.from_config(config.parallel, world)
    per = layout.world // layout.pp
    lines = ["per-rank memory (fp32 state; model: moetrain.parallel.memory):"]
    for r in ranks if ranks is not None else rank_memory(config, world, model, device):
        first = r.pp_rank * per
        name = f"rank {first}" if per == 1 else f"ranks {first}-{first + per - 1}"
        lines.append(r.line(name + (f" (pipeline rank {r.pp_rank})" if layout.pp > 1 else "")))
    return lines
