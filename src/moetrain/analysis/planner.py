"""Parallel-layout planner: candidate layouts for N devices, each with the micro-batch, BTA tile count and
checkpointing that fit memory and train fastest (analysis/step.py), and a recommendation with its reason.

The family by expert count (:func:`preferred_family`), refined by memory fit: the next larger sharding when the
preferred family does not fit (DP -> EP x DP -> EP x PP), and only then smaller ones (e.g. one device: DP). G > 1
only where it lets a larger micro-batch fit and is at least ``BTA_MIN_GAIN`` faster than the best untiled option.
The rule, its search and what it prints: docs/bta.md, "moetrain plan".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrain.analysis.hardware import Hardware
from moetrain.analysis.params import count_params
from moetrain.analysis.shape import ModelShape
from moetrain.analysis.step import Estimate, Layout, Workload, estimate

FAMILY_ORDER = ("DP", "EPxDP", "EPxPP")
BTA_MIN_GAIN = 0.02  # a tiled option must be at least 2% faster to be recommended over G = 1


def preferred_family(num_experts: int) -> str:
    """DP for <= 8 experts, EP x DP for 9-32, EP x PP above 32."""
    if num_experts <= 8:
        return "DP"
    if num_experts <= 32:
        return "EPxDP"
    return "EPxPP"


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(max(limit, 0).bit_length())]


def candidate_layouts(shape: ModelShape, devices: int, global_batch: int, max_pp: int = 8) -> list[Layout]:
    """Layouts of the three families for ``devices`` devices: ep a power of two dividing E, pp a power of two
    <= ``max_pp`` and <= L (1 with tied embeddings), dp the rest; the global batch must split over the ep * dp
    data-parallel ranks."""
    out = []
    # Tied embedding and LM head cannot be split over pipeline stages (the trainer refuses it): no pp > 1 then.
    for pp in _powers_of_two(1 if shape.tie_embeddings else min(max_pp, shape.n_layers)):
        for ep in _powers_of_two(shape.num_experts):
            if devices % (pp * ep) or shape.num_experts % ep:
                continue
            layout = Layout(dp=devices // (pp * ep), ep=ep, pp=pp)
            if layout.family in FAMILY_ORDER and global_batch % layout.data_parallel == 0:
                out.append(layout)
    return out


@dataclass
class Candidate:
    """A layout with its best workload options: ``best`` (any G) and ``untiled`` (G = 1); ``None`` when nothing
    fits."""

    layout: Layout
    best: Estimate | None
    untiled: Estimate | None
    smallest: Estimate  # the lowest-memory option, to show how far from fitting a layout is
    tiled: Estimate | None = None  # the fastest fitting option with G > 1

    @property
    def fits(self) -> bool:
        return self.best is not None


def plan_layout(
    shape: ModelShape, moe_flags: list[bool], layout: Layout, hw: Hardware, seq: int, global_batch: int,
    act_bytes: int = 2, max_tiles: int = 16,
) -> Candidate:
    """Search micro-batch, G and checkpointing for one layout."""
    counts = count_params(shape)
    per_rank = global_batch // layout.data_parallel
    # Checkpointed blocks recompute the experts anyway; recomputing them alone is a lever without it.
    options = [Workload(seq=seq, global_batch=global_batch, micro_batch=mb, bta_tiles=g, checkpoint=ckpt,
                        recompute_experts=rexp, act_bytes=act_bytes)
               for mb in _powers_of_two(per_rank) if per_rank % mb == 0
               for g in _powers_of_two(min(mb, max_tiles))
               for ckpt, rexp in ((False, False), (False, True), (True, False))]
    estimates = [estimate(shape, moe_flags, layout, work, hw, counts) for work in options]
    fitting = [e for e in estimates if e.fits]
    best = min(fitting, key=lambda e: e.step_s, default=None)
    untiled = min((e for e in fitting if e.workload.bta_tiles == 1), key=lambda e: e.step_s, default=None)
    tiled = min((e for e in fitting if e.workload.bta_tiles > 1), key=lambda e: e.step_s, default=None)
    if best is not None and untiled is not None and best.workload.bta_tiles > 1:
        if best.step_s > untiled.step_s * (1 - BTA_MIN_GAIN):
            best = untiled
    # per_rank >= 1 (global_batch >= data_parallel), so mb = g = 1 always ran: there is a smallest option
    smallest = min(estimates, key=lambda e: e.memory)
    return Candidate(layout=layout, best=best, untiled=untiled, smallest=smallest, tiled=tiled)


@dataclass
class Plan:
    """All candidates (sorted by family order, then step time) and the recommendation with its reason."""

    candidates: list[Candidate]
    recommended: Candidate | None
    reason: str
    bta_reason: str
    notes: list[str] = field(default_factory=list)


def _best_step_s(c: Candidate) -> float:
    """The step time of fitting candidate ``c``'s best option."""
    assert c.best is not None  # only called on fitting candidates
    return c.best.step_s


def plan(
    shape: ModelShape, moe_flags: list[bool], devices: int, hw: Hardware, seq: int, global_batch: int,
    act_bytes: int = 2,
) -> Plan:
    """Plan ``global_batch`` sequences of ``seq`` tokens per step on ``devices`` ``hw`` devices."""
    layouts = candidate_layouts(shape, devices, global_batch)
    cands = [plan_layout(shape, moe_flags, l, hw, seq, global_batch, act_bytes) for l in layouts]
    order = {f: i for i, f in enumerate(FAMILY_ORDER)}
    cands.sort(key=lambda c: (order[c.layout.family], not c.fits, c.best.step_s if c.best else c.smallest.memory))
    first = preferred_family(shape.num_experts)
    # Preferred family, then more sharding, then (when nothing else exists or fits) less.
    families = list(FAMILY_ORDER[order[first]:]) + list(reversed(FAMILY_ORDER[: order[first]]))
    rule = (f"{shape.num_experts} experts -> {first} (<= 8: DP, 9-32: EP x DP, > 32: EP x PP)")
    chosen, reason = None, ""
    for fam in families:
        fitting = [c for c in cands if c.layout.family == fam and c.fits]
        if fitting:
            chosen = min(fitting, key=_best_step_s)
            reason = rule + (f"; fastest fitting {fam} layout" if fam == first
                             else f"; no {' or '.join(families[:families.index(fam)])} layout fits in memory "
                                  f"(or divides {devices} devices), so {fam}: the fastest fitting one")
            break
    if chosen is None:
        least = min(cands, key=lambda c: c.smallest.memory) if cands else None
        reason = rule + "; nothing fits: " + (
            f"the smallest option ({least.layout.label}) needs {least.smallest.memory / 1e9:.0f} GB per device of "
            f"{hw.mem_bytes / 1e9:.0f} GB; add devices" if least else "no layout divides the devices and batch")
        return Plan(cands, None, reason, "")
    notes = []
    faster = [c for c in cands if c.fits and _best_step_s(c) < _best_step_s(chosen) * 0.95]
    if faster:
        f = min(faster, key=_best_step_s)
        gain = 1 - _best_step_s(f) / _best_step_s(chosen)
        notes.append(f"{f.layout.label} ({f.layout.family}) is estimated {gain:.0%} "
                     f"faster; the expert-count rule prefers {chosen.layout.family}")
    return Plan(cands, chosen, reason, bta_reason(chosen), notes)


def bta_reason(c: Candidate) -> str:
    """Why G was chosen for candidate ``c``."""
    b, u = c.best, c.untiled
    assert b is not None  # only fitting candidates have a G (plan() calls this for its recommendation)
    g = b.workload.bta_tiles
    if g > 1:
        gain = 1 - b.step_s / u.step_s if u else float("nan")
        before = (f"micro-batch {u.workload.micro_batch}: {u.tokens_per_expert:.0f} tokens/expert, "
                  f"{u.expert_intensity:.0f} FLOP/B" if u else "no untiled micro-batch fits")
        if u and u.workload.checkpoint and not b.workload.checkpoint:
            before += " and activation checkpointing"
        return (f"BTA G={g}: micro-batch {b.workload.micro_batch} fits with attention in tiles of "
                f"{b.workload.micro_batch // g} sequences; {b.tokens_per_expert:.0f} tokens/expert per GEMM, "
                f"{b.expert_intensity:.0f} FLOP/B (ridge {b.ridge:.0f}) vs {before}; step {gain:.0%} faster")
    if b.expert_intensity >= b.ridge:
        why = (f"expert GEMMs already compute-bound at micro-batch {b.workload.micro_batch} "
               f"({b.expert_intensity:.0f} >= ridge {b.ridge:.0f} FLOP/B)")
    elif b.grad_accum == 1:
        why = f"the whole per-rank batch ({b.workload.micro_batch} sequences) already fits untiled"
    elif c.tiled is None or c.tiled.workload.micro_batch <= b.workload.micro_batch:
        why = (f"tiling the attention does not let a larger micro-batch than {b.workload.micro_batch} fit (the "
               "activations that remain, mostly the MoE layer's, scale with the whole micro-batch)")
    else:
        t = c.tiled
        why = (f"G={t.workload.bta_tiles} fits micro-batch {t.workload.micro_batch} ({t.tokens_per_expert:.0f} "
               f"tokens/expert) but its estimated step is {t.step_s / b.step_s - 1:+.0%} vs untiled: the attention "
               f"recompute{' and checkpointing cost' if t.workload.checkpoint else ' costs'} more than the GEMMs gain")
    return f"BTA G=1 (off): {why}"


def trainer_fields(c: Candidate, seq: int, dtype: str) -> dict:
    """The run-config fields (nested dict) that train candidate ``c``'s best option: FSDP2 over the planner's
    ``dp`` (``parallel.dp_shard``, so weights, gradients and AdamW state are sharded: at most the planner's
    ZeRO-1 memory), ``ep``, ``pp``; ``train.batch_size`` is the global micro-batch (micro-batch x data-parallel
    ranks), ``train.grad_accum`` the accumulation steps (the pipeline's micro-batches when ``pp > 1``).

    Raises:
        ValueError: ``c`` has no fitting option.
    """
    if c.best is None:
        raise ValueError(f"{c.layout.label}: no option fits in memory")
    e, lay = c.best, c.layout
    w = e.workload
    return {
        "model": {"execution": {"bta_tiles": w.bta_tiles, "recompute_experts": bool(w.recompute_experts)}},
        "data": {"seq_len": seq},
        "train": {"batch_size": w.micro_batch * lay.data_parallel, "grad_accum": e.grad_accum, "dtype": dtype},
        "parallel": {"pp": lay.pp, "ep": lay.ep, "dp_shard": lay.dp, "dp_replicate": 1,
                     "activation_checkpoint": "full" if w.checkpoint else "none"},
    }


def smallest_fitting(shape: ModelShape, moe_flags: list[bool], hw: Hardware, seq: int, global_batch: int,
                     act_bytes: int = 2, max_devices: int = 4096) -> tuple[int, Plan] | None:
    """The fewest devices (powers of two up to ``max_devices``) for which the planner recommends a layout, with
    that plan; ``None`` when even ``max_devices`` do not suffice."""
    n = 1
    while n <= max_devices:
        result = plan(shape, moe_flags, n, hw, seq, global_batch, act_bytes)
        if result.recommended is not None:
            return n, result
        n *= 2
    return None
