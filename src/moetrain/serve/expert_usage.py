"""Expert usage per MoE layer: how many token assignments each expert receives, from the training run's routing
statistics or from a calibration pass. Read by the hot/cold expert store (which experts stay resident) and by
``moetrain placement`` (which experts to replicate).

Legend: L = MoE layers, E = experts.

Two sources:
- the run's ``metrics.jsonl``: each logging interval writes ``moe/layer{block}/tokens`` (assignments per expert
  over that interval, all ranks; moetrain/train/monitor.py). We sum the last ``intervals`` intervals logged at or
  before the served checkpoint's step, so the figure describes the router as it was saved (early training routes
  very differently);
- a calibration pass: the serving forward (fixed, trained top-k) over some text, counting each layer's kept
  assignments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moetrain.errors import MoetrainError
from moetrain.train.metrics import read_records


@dataclass(frozen=True)
class ExpertUsage:
    """Assignments per expert of every MoE layer.

    Attributes:
        blocks: [L] transformer-block index of each MoE layer.
        counts: [L, E] float64 assignments (token x top-k slots) per expert.
        source: where the counts come from (``metrics.jsonl steps A-B``, ``calibration (N tokens)``, ``uniform``).
    """

    blocks: tuple[int, ...]
    counts: torch.Tensor
    source: str

    def shares(self) -> torch.Tensor:
        """[L, E] each expert's share of its layer's assignments (rows sum to 1; a layer with no counts is
        uniform)."""
        c = self.counts.double()
        total = c.sum(dim=1, keepdim=True)
        return torch.where(total > 0, c / total.clamp(min=1e-300), 1.0 / c.shape[1])

    def layer(self, block: int) -> torch.Tensor:
        """[E] counts of the MoE layer in transformer block ``block``.

        Raises:
            KeyError: ``block`` is not an MoE layer of this usage.
        """
        return self.counts[self.blocks.index(block)]


def uniform_usage(blocks: list[int], num_experts: int) -> ExpertUsage:
    """Equal counts everywhere (nothing known about the router)."""
    return ExpertUsage(tuple(blocks), torch.ones(len(blocks), num_experts, dtype=torch.float64), "uniform")


def usage_from_metrics(metrics_file: str | Path, blocks: list[int], num_experts: int, up_to_step: int | None = None,
                       intervals: int = 10) -> ExpertUsage | None:
    """Usage from a run's ``metrics.jsonl``: the sum of the last ``intervals`` logging intervals at or before
    ``up_to_step`` (all of them when ``None``) that carry ``moe/layer{b}/tokens`` for every block ``b``.

    Returns:
        The usage, or ``None`` when the file is missing or holds no such interval.
    Raises:
        MoetrainError: a layer's counts do not have ``num_experts`` entries (naming the file, step and key).
    """
    path = Path(metrics_file)
    keys = [f"moe/layer{b}/tokens" for b in blocks]
    rows: list[tuple[int, list[list[float]]]] = []
    for rec in read_records(path)[0]:  # lines cut short by a run in progress skipped
        if not all(k in rec for k in keys) or (up_to_step is not None and rec["step"] > up_to_step):
            continue
        for k in keys:
            if len(rec[k]) != num_experts:
                raise MoetrainError(f"{path}: step {rec['step']}: {k} has {len(rec[k])} entries, the model has "
                                    f"{num_experts} experts")
        rows.append((rec["step"], [rec[k] for k in keys]))
    if not rows:
        return None
    rows = rows[-intervals:]
    counts = torch.tensor([r[1] for r in rows], dtype=torch.float64).sum(dim=0)  # [L, E]
    return ExpertUsage(tuple(blocks), counts, f"{path.name} steps {rows[0][0]}-{rows[-1][0]}")


@torch.inference_mode()
def calibrate_usage(model, token_ids: list[int], chunk: int | None = None, name: str = "calibration") -> ExpertUsage:
    """Usage from a calibration pass: the serving forward (the trained top-k) over ``token_ids`` in chunks of
    ``chunk`` tokens (default: the model's context), counting each MoE layer's assignments. ``name`` says in an error
    where the tokens came from (``--calibration-text FILE``).

    Raises:
        MoetrainError: fewer than 2 tokens, or a model without MoE layers.
    """
    from moetrain.serve.forward import StepBatch, StepRunner
    from moetrain.model.attention import KVCache
    from moetrain.serve.moe import StepPolicies
    from moetrain.serve.routing import RoutingPolicy

    cfg = model.config
    blocks = [i for i, b in enumerate(model.blocks) if b.is_moe]
    if not blocks:
        raise MoetrainError("calibration: the model has no MoE layers")
    if len(token_ids) < 2:
        raise MoetrainError(f"{name}: needs at least 2 tokens, got {len(token_ids)}")
    size = chunk or cfg.max_seq_len
    runner = StepRunner(model, KVCache(cfg.n_layers, 1, cfg.max_seq_len))
    counts = torch.zeros(len(blocks), model.blocks[blocks[0]].ffn.config.num_experts, dtype=torch.float64)
    for start in range(0, len(token_ids), size):
        part = token_ids[start:start + size]
        _, stats = runner.step(StepBatch.build([(0, 0, part)]), StepPolicies(((RoutingPolicy(), len(part)),)))
        counts += torch.stack([s.counts.double() for s in stats])
    return ExpertUsage(tuple(blocks), counts, f"calibration ({len(token_ids)} tokens)")


def served_usage(served, calibration_text: str | None = None, name: str = "calibration") -> ExpertUsage:
    """The usage to rank a served model's experts by: a calibration pass over ``calibration_text`` (a file's
    contents) when given, else the run's ``metrics.jsonl`` up to the served checkpoint's step, else uniform.

    Args:
        served: a :class:`~moetrain.serve.loader.ServedModel` (experts still loaded).
        calibration_text: text to calibrate on; ``None`` = use the run's statistics.
        name: where ``calibration_text`` came from, for errors (``--calibration-text FILE``).
    """
    model = served.model
    blocks = [i for i, b in enumerate(model.blocks) if b.is_moe]
    e = model.blocks[blocks[0]].ffn.config.num_experts
    if calibration_text is not None:
        return calibrate_usage(model, served.tokenizer.encode(calibration_text).ids, name=name)
    found = usage_from_metrics(Path(served.root) / "metrics.jsonl", blocks, e, served.step) if served.root else None
    return found or uniform_usage(blocks, e)
