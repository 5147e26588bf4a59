"""Expert placement for expert-parallel serving: which rank holds which experts, with the hottest replicated
(DeepSeek's expert-parallel load balancer, EPLB: github.com/deepseek-ai/EPLB, ``eplb.py``; the steps and outputs:
docs/serving.md).

Legend: L = MoE layers, E = logical experts, R = redundant experts, P = E + R physical experts, N = EP ranks,
G = P / N physical experts per rank.

Per layer, from the expert usage (moetrain/serve/expert_usage.py), EPLB's global policy (one node, no groups):
:func:`replicate` (R replicas, each to the expert with the largest load per replica; a token goes to one of an
expert's replicas evenly), :func:`pack` (heaviest first onto the least loaded rank with room; physical expert
``rank * G + slot``, as SGLang), then ours, :func:`refine` (swaps while they lower the larger of two ranks' loads:
greedy packing alone can lose to the contiguous split on nearly balanced usage). With R = 0 the contiguous split is
a candidate too, so a placement is never predicted worse than none.

Outputs: SGLang's ``--init-expert-location`` JSON (:func:`sglang_json`: ``{"physical_to_logical_map": [...]}``, one
row per transformer layer, the trivial map ``p % E`` for layers without experts) and our own file
(:func:`placement_dict`, read by :func:`load_placement`). Predicted load: the usage's assignments per rank, before =
the contiguous split without replicas (how the expert-parallel dispatcher shards), after = this placement; the
figure of merit is max / mean over ranks (1.0 = balanced).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moetrain.errors import MoetrainError

FORMAT = "moetrain-expert-placement"


@dataclass(frozen=True)
class LayerPlacement:
    """One MoE layer's placement.

    Attributes:
        physical_to_logical: [P] logical expert of each physical expert (rank-major: rank r holds ``[r*G, (r+1)*G)``).
        replicas: [E] physical copies of each logical expert (>= 1).
        load_before / load_after: [N] predicted assignments per rank without / with this placement.
    """

    physical_to_logical: list[int]
    replicas: list[int]
    load_before: list[float]
    load_after: list[float]

    @staticmethod
    def imbalance(load: list[float]) -> float:
        """max / mean of a per-rank load (1.0 = balanced; 1.0 for all-zero loads)."""
        mean = sum(load) / len(load)
        return max(load) / mean if mean > 0 else 1.0


def replicate(counts: list[float], num_physical: int) -> list[int]:
    """Replicas per expert: start with one each, then add one at a time to the expert with the largest
    ``count / replicas`` (ties: the lowest index).

    Args:
        counts: [E] assignments per expert.
        num_physical: P >= E.
    Returns:
        [E] replicas per expert, summing to P.
    """
    reps = [1] * len(counts)
    for _ in range(num_physical - len(counts)):
        best = max(range(len(counts)), key=lambda e: (counts[e] / reps[e], -e))
        reps[best] += 1
    return reps


def pack(loads: list[float], num_ranks: int) -> list[int]:
    """Balanced packing of P items into N equal-size packs: heaviest first (ties: lower index), each onto the
    least loaded pack that still has room (ties: the lower pack).

    Args:
        loads: [P] item weights; P must be divisible by N.
    Returns:
        [P] pack of each item.
    """
    per = len(loads) // num_ranks
    pack_load, pack_items = [0.0] * num_ranks, [0] * num_ranks
    where = [0] * len(loads)
    for i in sorted(range(len(loads)), key=lambda j: (-loads[j], j)):
        r = min((r for r in range(num_ranks) if pack_items[r] < per), key=lambda r: (pack_load[r], r))
        where[i] = r
        pack_load[r] += loads[i]
        pack_items[r] += 1
    return where


def refine(loads: list[float], where: list[int], num_ranks: int) -> list[int]:
    """Swap items between the most loaded pack and another while the larger of the two packs' loads falls
    (pack sizes unchanged; ends at a local optimum; strictly decreasing, so it terminates).

    Args:
        loads: [P] item weights.  where: [P] pack of each item (from :func:`pack`).
    Returns:
        [P] the improved packs.
    """
    where = list(where)
    while True:
        totals = [0.0] * num_ranks
        for i, r in enumerate(where):
            totals[r] += loads[i]
        top = max(range(num_ranks), key=lambda r: (totals[r], -r))
        best = None  # (new larger load, i, j)
        for i in (i for i in range(len(loads)) if where[i] == top):
            for j in (j for j in range(len(loads)) if where[j] != top):
                delta = loads[i] - loads[j]
                if delta <= 0:
                    continue
                worst = max(totals[top] - delta, totals[where[j]] + delta)
                if worst < totals[top] - 1e-9 * max(1.0, totals[top]) and (best is None or worst < best[0]):
                    best = (worst, i, j)
        if best is None:
            return where
        _, i, j = best
        where[i], where[j] = where[j], where[i]


def place_layer(counts: list[float], ep: int, redundant: int) -> LayerPlacement:
    """The placement of one layer with ``counts`` [E] assignments per expert over ``ep`` ranks and ``redundant``
    extra replicas.

    Raises:
        MoetrainError: ``ep`` < 1, ``redundant`` < 0, E not divisible by ``ep`` (the trivial split needs it), or
            E + ``redundant`` not divisible by ``ep``.
    """
    e = len(counts)
    if ep < 1:
        raise MoetrainError(f"--ep: must be >= 1, got {ep}")
    if redundant < 0:
        raise MoetrainError(f"--redundant: must be >= 0, got {redundant}")
    if e % ep:
        raise MoetrainError(f"--ep: {ep} ranks do not divide the {e} experts")
    if (e + redundant) % ep:
        raise MoetrainError(f"--redundant: {e} experts + {redundant} redundant = {e + redundant} physical experts, "
                            f"not divisible by --ep {ep}")
    p, per = e + redundant, (e + redundant) // ep
    reps = replicate(counts, p)
    logical = [x for x in range(e) for _ in range(reps[x])]  # [P] before packing: each expert's replicas
    loads = [counts[x] / reps[x] for x in logical]
    where = refine(loads, pack(loads, ep), ep)
    slots: list[list[int]] = [[] for _ in range(ep)]
    for i in sorted(range(p), key=lambda j: (-loads[j], j)):  # heaviest first within a rank
        slots[where[i]].append(logical[i])
    phys = [x for r in range(ep) for x in slots[r]]
    before = [sum(counts[r * (e // ep):(r + 1) * (e // ep)]) for r in range(ep)]
    after = [sum(counts[x] / reps[x] for x in phys[r * per:(r + 1) * per]) for r in range(ep)]
    if redundant == 0 and max(before) <= max(after):  # the contiguous split is at least as good: keep it
        phys, after = list(range(e)), list(before)
    return LayerPlacement(phys, reps, before, after)


def place(counts: torch.Tensor, ep: int, redundant: int) -> list[LayerPlacement]:
    """:func:`place_layer` for every row of ``counts`` [L, E]."""
    return [place_layer(row, ep, redundant) for row in counts.double().tolist()]


def sglang_json(layers: list[LayerPlacement], blocks: list[int], n_layers: int, num_experts: int) -> dict:
    """SGLang's ``--init-expert-location`` dict: ``physical_to_logical_map`` [n_layers, P], MoE blocks' rows from
    ``layers``, other rows trivial (``p % E``)."""
    p = len(layers[0].physical_to_logical)
    rows = [[x % num_experts for x in range(p)] for _ in range(n_layers)]
    for b, lp in zip(blocks, layers):
        rows[b] = list(lp.physical_to_logical)
    return {"physical_to_logical_map": rows}


def placement_dict(layers: list[LayerPlacement], blocks: list[int], ep: int, redundant: int, num_experts: int,
                   source: str) -> dict:
    """Our own placement file (read by :func:`load_placement`)."""
    per = (num_experts + redundant) // ep
    return {
        "format": FORMAT, "version": 1, "ep": ep, "redundant": redundant, "num_experts": num_experts,
        "usage": source,
        "layers": {str(b): {
            "physical_to_logical": lp.physical_to_logical,
            "rank_of_physical": [i // per for i in range(len(lp.physical_to_logical))],
            "replicas": lp.replicas,
            "predicted_load_before": lp.load_before, "predicted_load_after": lp.load_after,
        } for b, lp in zip(blocks, layers)},
    }


def load_placement(path: str | Path, blocks: list[int], num_experts: int, ep: int | None = None
                   ) -> dict[int, LayerPlacement]:
    """Read our placement file and check it against a model (its MoE ``blocks`` and ``num_experts``) and, when
    given, the serving ``ep``.

    Returns:
        MoE block -> :class:`LayerPlacement`.
    Raises:
        MoetrainError: unreadable, another format, or not fitting the model (naming the key and values): a block
            missing, an expert id out of range, an expert without a replica, P not divisible by ep, the file's ep
            not ``ep``.
    """
    f = Path(path)
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise MoetrainError(f"{f}: cannot read the placement: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise MoetrainError(f"{f}: format: expected {FORMAT!r} (written by `moetrain placement`), got "
                            f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}")
    if d.get("num_experts") != num_experts:
        raise MoetrainError(f"{f}: num_experts: {d.get('num_experts')}, the model has {num_experts}")
    if ep is not None and d.get("ep") != ep:
        raise MoetrainError(f"{f}: ep: the placement is for {d.get('ep')} ranks, but serving runs {ep} "
                            f"(parallel.ep={ep}; write one with `moetrain placement RUN --ep {ep}`)")
    out = {}
    for b in blocks:
        lay = d.get("layers", {}).get(str(b))
        if lay is None:
            raise MoetrainError(f"{f}: layers.{b}: missing (the model's MoE blocks are {blocks})")
        phys = lay["physical_to_logical"]
        if any(not isinstance(x, int) or not 0 <= x < num_experts for x in phys):
            raise MoetrainError(f"{f}: layers.{b}.physical_to_logical: expert ids must be in [0, {num_experts})")
        if sorted(set(phys)) != list(range(num_experts)):
            raise MoetrainError(f"{f}: layers.{b}.physical_to_logical: every expert needs a replica; missing "
                                f"{sorted(set(range(num_experts)) - set(phys))}")
        if len(phys) % d["ep"]:
            raise MoetrainError(f"{f}: layers.{b}.physical_to_logical: {len(phys)} physical experts, not divisible "
                                f"by ep {d['ep']}")
        out[b] = LayerPlacement(phys, [phys.count(x) for x in range(num_experts)], lay["predicted_load_before"],
                                lay["predicted_load_after"])
    return out
