"""Routing-health monitor: attaches to a model's MoE layers, turns their per-micro-batch records into per-layer
statistics, alarms, ``metrics.jsonl`` fields and TensorBoard histograms / heatmaps (docs/routing-health.md).

The monitor is attached from outside (forward hooks on each MoE layer, active only in training mode and not in an
activation-checkpointing recompute), so the model and the optimizer step stay unaware of it. The trainer calls:

    monitor = RoutingMonitor(model, config.monitor, run_dir, log, start_step)
    monitor.end_step(step, result.lm_loss)              # every optimizer step: queues, no kernel, no host sync
    record.update(monitor.flush(step, metrics.writer))  # logging steps: one host read, alarms, TensorBoard

``metrics.jsonl`` keys: :func:`snapshot_record`. Under pipeline parallelism (:class:`StageRouting`) the other
stages' per-layer sums (:class:`~moetrain.train.routing_stats.StepSummary`) reach rank 0 after every optimizer step
(one small collective), whose statistics then cover every MoE layer as one rank observing them all would.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from tensorboard.compat.proto.summary_pb2 import Summary

from moetrain.moe.layer import MoEAux
from moetrain.parallel.ac import in_recompute
from moetrain.train.alerts import ALERTS_FILE, AlertTracker, TrainingAlarm
from moetrain.train.metrics import truncate_records
from moetrain.train.monitor_config import MonitorConfig
from moetrain.train.routing_stats import RoutingStats, Snapshot, StepSummary, find_loss_fields

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from moetrain.moe.layer import MoELayer

# A 5-stop approximation of matplotlib's "viridis" (perceptually uniform, readable in grey), so training needs no
# matplotlib for the TensorBoard heatmap.
_VIRIDIS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)


def colorize(values: np.ndarray, vmax: float) -> np.ndarray:
    """[H, W] values in [0, vmax] -> [H, W, 3] uint8 viridis-like colours."""
    x = np.clip(values / max(vmax, 1e-12), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    lo = np.floor(x).astype(int).clip(0, len(_VIRIDIS) - 2)
    frac = (x - lo)[..., None]
    rgb: np.ndarray = ((1 - frac) * _VIRIDIS[lo] + frac * _VIRIDIS[lo + 1]).round().astype(np.uint8)
    return rgb


@dataclass(frozen=True)
class StageRouting:
    """How a pipeline rank's monitor reaches the rank that writes metrics (built by the pipeline engine:
    ``moetrain.parallel.engine.ShardedHooks.stage_routing``).

    Attributes:
        layer_ids: every MoE layer of the model (block indices, in order): the rows of the exchange.
        num_experts: E of the MoE layers.
        top_k: K of the MoE layers.
        expert_bias: the routers keep an aux-loss-free bias (reported per layer).
        loss_names: the MoE record's loss fields, the same on every rank.
        main: this rank writes metrics and alarms (rank 0).
        reduce: sums [L, W] float64 rows over the ranks of rank 0's pipeline (a collective: every rank of it calls
            it once per optimizer step); the sum on the main rank, ``None`` on the others.
    """

    layer_ids: list[int]
    num_experts: int
    top_k: int
    expert_bias: bool
    loss_names: list[str]
    main: bool
    reduce: Callable[[torch.Tensor], torch.Tensor | None]


class RoutingMonitor:
    """Routing statistics and alarms for every MoE layer of ``model``.

    Args:
        model: a model with ``blocks`` (each with ``is_moe`` and ``ffn``), e.g. ``MoETransformer``.
        config: the run's :class:`MonitorConfig` (``enabled=False`` makes every method a no-op).
        run_dir: where ``alerts.jsonl`` is appended.
        log: prints alarm lines.
        start_step: optimizer steps already done (a resumed run).
        stages: a pipeline rank's exchange with rank 0 (:class:`StageRouting`); ``None`` when this rank's model
            holds every MoE layer it reports.
    """

    def __init__(self, model: torch.nn.Module, config: MonitorConfig, run_dir: Path,
                 log: Callable[[str], None] = print, start_step: int = 0, stages: StageRouting | None = None):
        self.config, self.run_dir, self.enabled = config, Path(run_dir), config.enabled
        blocks = getattr(model, "blocks", [])
        # A pipeline stage's blocks (moetrain.parallel.pipeline_runner.LocalModel) are keyed by their global index.
        indexed = ([(int(k), b) for k, b in blocks.items()] if isinstance(blocks, torch.nn.ModuleDict)
                   else list(enumerate(blocks)))
        # is_moe: the block's ffn is a MoELayer
        self.layers = [(i, cast("MoELayer", b.ffn)) for i, b in indexed if getattr(b, "is_moe", False)]
        moe_cfg = self.layers[0][1].config if self.layers else None
        self.num_experts = stages.num_experts if stages else (moe_cfg.num_experts if moe_cfg else 0)
        self.top_k = stages.top_k if stages else (moe_cfg.top_k if moe_cfg else 1)
        device = next(model.parameters()).device
        self.routing = stages
        layer_ids = stages.layer_ids if stages else [i for i, _ in self.layers]
        self.positions = [layer_ids.index(i) for i, _ in self.layers]  # each local layer's row
        self.remote = [p for p in range(len(layer_ids)) if p not in set(self.positions)]
        self.main = stages is None or stages.main  # writes metrics and alarms
        # This rank's records of a step (a pipeline's rank 0 receives the other stages' rows summed with its own).
        loss_names = stages.loss_names if stages else find_loss_fields(MoEAux)
        self.summary = StepSummary(len(layer_ids), self.num_experts, loss_names, device)
        self._remote_bias: torch.Tensor | None = None  # [L, E] the other stages' biases after the last step
        self.stats = RoutingStats(layer_ids, self.num_experts, self.top_k, device,
                                  config.spike_window, config.spike_warmup, start_step, config.collapse_window)
        self.alerts = AlertTracker(config, self.run_dir / ALERTS_FILE, self.top_k, log)
        if start_step > 0 and self.main:  # resumed: the steps after the checkpoint run again, so do their alarms
            truncate_records(self.run_dir / ALERTS_FILE, start_step)
        # per layer, the last heatmap_history logging steps' token shares [E]
        self.history: list[deque[list[float]]] = [deque(maxlen=config.heatmap_history) for _ in layer_ids]
        self.flushes = 0
        self._writer: Any = None  # a SummaryWriter
        self._last_step: int | None = None
        self._heatmap_step: int | None = None
        if self.enabled and config.tb_heatmap:  # import Pillow now (~0.1 s once), not in training at the first heatmap
            with contextlib.suppress(ImportError):
                import PIL.Image  # noqa: F401
        self._handles: list[RemovableHandle] = []
        self.attach()

    def attach(self) -> None:
        """Start observing the MoE layers (forward hooks; done by the constructor; no-op when disabled or attached)."""
        if self.enabled and not self._handles:
            self._handles = [layer.register_forward_hook(functools.partial(self._observe, pos))
                             for pos, (_, layer) in zip(self.positions, self.layers)]

    def detach(self) -> None:
        """Stop observing the MoE layers (remove the hooks); :meth:`attach` resumes."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _observe(self, pos: int, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        """The forward hook of MoE layer ``pos``: adds its record. Training forwards with gradients only: evaluation
        (model.eval()), generation, and the no-grad routing pre-pass of the global-batch aux loss
        (MoETransformer.moe_counts) must not count, nor a layer recomputed inside backward by activation
        checkpointing (moetrain.parallel.ac)."""
        if module.training and torch.is_grad_enabled() and isinstance(output, tuple) and not in_recompute():
            self.summary.add(pos, output[-1])

    def end_step(self, step: int, lm_loss: torch.Tensor | float | None) -> None:
        """Close optimizer step ``step`` (steps done so far); ``lm_loss`` is the step's scalar LM loss (device
        tensor: no host sync). In a pipeline, first every stage's rows (with its routers' biases) reach rank 0 (a
        collective)."""
        if not self.enabled:
            return
        rows = None
        if self.routing is not None:
            biases = self._biases() if not self.main and self.routing.expert_bias else None  # this rank's layers only
            rows = self.routing.reduce(self.summary.take(biases))
            if self.main and rows is not None and self.routing.expert_bias:
                at = self.summary.vectors + 2 * self.num_experts
                self._remote_bias = rows[:, at:at + self.num_experts].clone()
        if self.main:
            self.stats.end_step(step, lm_loss, self.summary, rows)

    def _biases(self) -> list[torch.Tensor | None]:
        """[E] aux-loss-free bias of every layer of the statistics (``None`` where there is none)."""
        out: list[torch.Tensor | None] = [None] * len(self.stats.layer_ids)
        for pos, (_, layer) in zip(self.positions, self.layers):
            out[pos] = layer.router.e_score_correction_bias
        if self._remote_bias is not None:
            for pos in self.remote:
                out[pos] = self._remote_bias[pos]
        return out

    def flush(self, step: int, writer: Any = None) -> dict[str, Any]:
        """At a logging step: read the interval's statistics (one host sync), evaluate the alarms, write
        TensorBoard histograms / heatmaps to ``writer`` (a ``SummaryWriter`` or ``None``), and return the
        ``metrics.jsonl`` fields (see the module docstring; scalars are mirrored to TensorBoard by the metrics
        logger); ``{}`` on a pipeline rank other than rank 0."""
        if not self.enabled or not self.main:
            return {}
        snap = self.stats.snapshot(self._biases())
        self.last_snapshot = snap
        self.alerts.update(snap)
        if writer is not None:
            self._tensorboard(snap, writer, step)
        return snapshot_record(snap, self.config.dead_steps, self.top_k)

    def raise_if_fatal(self, checkpoint: Callable[[], Any] | None = None) -> None:
        """If a fatal alarm fired: write a checkpoint through ``checkpoint()`` (skipped for a non-finite loss,
        whose weights may be non-finite: the previous checkpoint stays the newest), then raise it.

        Raises:
            TrainingAlarm: a ``monitor.fatal`` alarm fired.
        """
        alert = self.alerts.fatal
        if alert is None:
            return
        note = ""
        if checkpoint is not None and alert.kind != "nonfinite_loss":
            checkpoint()
            note = f" A checkpoint of step {alert.step} was written."
        raise TrainingAlarm(alert, note)

    def _tensorboard(self, snap: Snapshot, writer: Any, step: int) -> None:
        """Histograms (and, every ``tb_heatmap_every`` logging steps, heatmaps) of every layer as ONE event: each
        TensorBoard event costs a hand-over to the writer thread, which dominated the monitor's cost when written
        one per layer and kind."""
        from torch.utils.tensorboard.summary import histogram, histogram_raw

        values = []
        self.flushes += 1
        for pos, ls in enumerate(snap.layers):
            # Plain Python on these short lists: numpy's per-call overhead is larger at E <= 128.
            tag, tokens = f"moe/layer{ls.layer}", ls.tokens
            total = sum(tokens)
            self.history[pos].append([t * self.top_k / total for t in tokens] if total > 0 else [0.0] * len(tokens))
            if self.config.tb_histograms and total > 0:
                # Raw buckets: bucket e is expert e, its height the expert's tokens (a bar chart over experts).
                values += histogram_raw(  # type: ignore[no-untyped-call]  # untyped in torch
                    f"{tag}/tokens_per_expert", min=0.0, max=float(len(tokens) - 1), num=float(total),
                    sum=float(sum(e * t for e, t in enumerate(tokens))),
                    sum_squares=float(sum(e * e * t for e, t in enumerate(tokens))),
                    bucket_limits=[e + 0.5 for e in range(len(tokens))], bucket_counts=list(tokens)).value
            if self.config.tb_histograms and ls.bias is not None:
                values += histogram(  # type: ignore[no-untyped-call]  # untyped in torch
                    f"{tag}/bias", np.asarray(ls.bias), bins="auto").value
        if self.config.tb_heatmap and self.flushes % self.config.tb_heatmap_every == 0:
            values += self._heatmaps()
            self._heatmap_step = step
        if values:
            writer._get_file_writer().add_summary(Summary(value=values), step)
        self._writer, self._last_step = writer, step

    def _heatmaps(self) -> list[Any]:
        """One image per layer: experts as rows, logging steps as columns, colour = share of the layer's tokens
        (0..1, 1 = every token chose the expert). ``[]`` without Pillow (TensorBoard encodes PNGs with it)."""
        try:
            import PIL  # noqa: F401
        except ImportError:
            return []
        from torch.utils.tensorboard.summary import image

        out: list[Any] = []  # Summary.Value protos
        for pos, ls in enumerate(self.last_snapshot.layers):
            if not self.history[pos]:
                continue
            shares = np.asarray(self.history[pos], dtype=np.float64).T  # [E, H]
            rows, cols = max(1, 64 // shares.shape[0]), max(1, 256 // shares.shape[1])  # ~64 x 256 px
            rgb = np.repeat(np.repeat(colorize(shares, 1.0), rows, axis=0), cols, axis=1)  # [H, W, 3]
            out += image(  # type: ignore[no-untyped-call]  # untyped in torch
                f"moe/layer{ls.layer}/load_heatmap", rgb, dataformats="HWC").value
        return out

    def state_dict(self) -> dict[str, Any] | None:
        """Statistics windows and alarm episodes, for exact continuation after a resume (``None`` when disabled: it
        saw no step, so a resume that enables it starts afresh at the resumed step)."""
        if not self.enabled:
            return None
        return {"stats": self.stats.state_dict(), "alerts": self.alerts.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` output (``None``: a checkpoint from before monitoring; start afresh)."""
        if state:
            self.stats.load_state_dict(state["stats"])
            self.alerts.load_state_dict(state["alerts"])

    def close(self) -> None:
        """Write the final heatmaps (if the last logging step had none) and detach the hooks. Call it before the
        TensorBoard writer is closed."""
        if self._writer is not None and self.config.tb_heatmap and self._heatmap_step != self._last_step:
            values = self._heatmaps()
            if values:
                self._writer._get_file_writer().add_summary(Summary(value=values), self._last_step)
            self._heatmap_step = self._last_step
        self.detach()


def snapshot_record(snap: Snapshot, dead_steps: int, top_k: int) -> dict[str, Any]:
    """The flat ``metrics.jsonl`` fields of one snapshot (``L`` is the transformer-block index of the MoE layer;
    statistics over the logging interval, defined in :mod:`moetrain.train.routing_stats`):

        moe/layerL/tokens         [E] assignments per expert (list)      moe/layerL/cv, overload, max_share
        moe/layerL/max_share_window  max share over the last monitor.collapse_window steps (the collapse alarm's)
        moe/layerL/dead           [ids] experts idle >= dead_steps        moe/layerL/n_dead
        moe/layerL/entropy        router entropy (nats)                   moe/layerL/router_z   mean logsumexp
        moe/layerL/<name>         each ``*loss`` field of the layer record (aux_loss, z_loss, ...), unweighted
        moe/layerL/drop_fraction  when the layer reports drops            moe/layerL/bias  [E] aux-loss-free biases
        moe/interval_steps        steps in the interval                   moe/loss_spike_ratio, moe/nonfinite_steps
    """
    rec: dict[str, Any] = {"moe/interval_steps": snap.steps, "moe/nonfinite_steps": snap.nonfinite_steps}
    if snap.spike_ratio is not None:
        rec["moe/loss_spike_ratio"] = snap.spike_ratio
    for ls in snap.layers:
        p = f"moe/layer{ls.layer}/"
        rec[p + "tokens"] = [round(t) for t in ls.tokens]
        for name in ("cv", "overload", "max_share", "entropy", "router_z"):
            rec[p + name] = getattr(ls, name)
        window_total = sum(ls.window_tokens)
        rec[p + "max_share_window"] = max(ls.window_tokens) / (window_total / top_k) if window_total > 0 else None
        for name, value in ls.losses.items():
            rec[p + name] = value
        if ls.drop_fraction is not None:
            rec[p + "drop_fraction"] = ls.drop_fraction
        rec[p + "dead"] = [e for e, idle in enumerate(ls.idle) if idle >= dead_steps]
        rec[p + "n_dead"] = len(rec[p + "dead"])
        if ls.bias is not None:
            rec[p + "bias"] = ls.bias
    return rec
