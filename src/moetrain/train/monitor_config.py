"""Configuration of routing-health monitoring: what is collected, and when each alarm fires (the alarms and why
each matters: docs/routing-health.md, after Switch Transformer, Fedus et al., 2021, sec. 2.2, and ST-MoE, Zoph et al.,
2022, sec. 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from moetrain.configlib import require, require_at_least

AlarmKind = Literal["dead_expert", "collapse", "token_drop", "loss_spike", "nonfinite_loss"]
ALARM_KINDS: tuple[str, ...] = get_args(AlarmKind)


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """Routing statistics (per MoE layer, per logging interval ``train.log_every``) and alarm thresholds.

    Alarms are evaluated at logging steps from statistics tracked at every step on the device, so nothing between
    two logging steps is missed; an alarm is printed and appended to ``RUN_DIR/alerts.jsonl`` once per episode
    (it re-arms when its condition has cleared at a later logging step).

    Fields:
        enabled: collect routing statistics and evaluate alarms (off: the trainer logs as before).
        dead_steps: an expert that received no tokens for this many consecutive optimizer steps is dead
            (>= 1; a value above ``train.steps`` silences the alarm).
        collapse_fraction: collapse alarm when one expert is chosen by more than this fraction of a layer's tokens
            over the last ``collapse_window`` steps (a token chooses K experts, so balanced routing gives K / E; in
            (0, 1]; 1.0 never fires). Not evaluated when K == E (every expert sees every token).
        collapse_window: steps of the rolling window the collapse share is measured over (all steps so far when
            fewer, so a collapse present from the start shows at the first logging step). A window longer than one
            logging interval keeps short bursts out: small routers with near-uniform probabilities can send most
            tokens of a few consecutive steps to the same experts and then move on (the ``tiny`` preset does).
        collapse_from_step: no collapse alarm at logging steps before this one (>= 0); ``None``: the end of the
            learning-rate warm-up (``train.warmup_steps``; the trainer fills it in): near-uniform routers that have
            barely moved from their initialisation can send most of a layer's tokens to one expert for a stretch of
            steps and then spread them. A collapse that lasts past this step is reported at the first logging step
            from it on (the window still holds it).
        drop_fraction: token-drop alarm when more than this fraction of a layer's (token, expert) assignments was
            dropped by the capacity limit over a logging interval (in [0, 1]; 1.0 never fires). Only for layers
            whose record reports dropped counts.
        spike_factor: loss-spike alarm when a step's LM loss exceeds ``spike_factor`` times the median of the
            previous ``spike_window`` steps' losses (> 1; 0 disables).
        spike_window: steps in the rolling median (>= 1).
        spike_warmup: finite losses the window must hold before a step is checked (>= 1, <= ``spike_window``).
        fatal: alarm kinds that stop training with an error (exit status 2) after writing a checkpoint
            (``nonfinite_loss`` writes none: the weights may already be non-finite; the previous checkpoint stays);
            needs ``enabled``.
        tb_histograms: write per-layer histograms (tokens per expert, aux-loss-free biases) to TensorBoard.
        tb_heatmap: write a per-layer expert-load heatmap image (experts x logging steps) to TensorBoard.
        tb_heatmap_every: logging steps between heatmap images (each shows the whole history, and encoding a PNG
            per layer is the costliest thing the monitor does); the last logging step always gets one.
        heatmap_history: logging steps kept for the TensorBoard heatmap (columns).
    """

    enabled: bool = True
    dead_steps: int = 100
    collapse_fraction: float = 0.9
    collapse_window: int = 20
    collapse_from_step: int | None = None
    drop_fraction: float = 0.1
    spike_factor: float = 1.5
    spike_window: int = 50
    spike_warmup: int = 10
    fatal: tuple[AlarmKind, ...] = ()
    tb_histograms: bool = True
    tb_heatmap: bool = True
    tb_heatmap_every: int = 10
    heatmap_history: int = 200

    def __post_init__(self) -> None:
        require_at_least(self, 1, "dead_steps", "collapse_window", "spike_window", "tb_heatmap_every",
                         "heatmap_history")
        require(0 < self.collapse_fraction <= 1, "collapse_fraction",
                f"must be in (0, 1], got {self.collapse_fraction}")
        require(self.collapse_from_step is None or self.collapse_from_step >= 0, "collapse_from_step",
                f"must be >= 0 (or null: the end of train.warmup_steps), got {self.collapse_from_step}")
        require(0 <= self.drop_fraction <= 1, "drop_fraction", f"must be in [0, 1], got {self.drop_fraction}")
        require(self.spike_factor == 0 or self.spike_factor > 1, "spike_factor",
                f"must be > 1 (or 0 to disable), got {self.spike_factor}")
        require(1 <= self.spike_warmup <= self.spike_window, "spike_warmup",
                f"must be in [1, spike_window={self.spike_window}], got {self.spike_warmup}")
        for kind in self.fatal:
            require(kind in ALARM_KINDS, "fatal", f"unknown alarm {kind!r}; choose from {list(ALARM_KINDS)}")
        require(self.enabled or not self.fatal, "fatal",
                f"{list(self.fatal)} needs monitor.enabled=true (a disabled monitor evaluates no alarm, so none would "
                "stop the run); set monitor.fatal=[] or enable the monitor")
