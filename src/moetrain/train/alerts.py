"""Routing-health alarms: conditions on a :class:`~moetrain.train.routing_stats.Snapshot`, episodes, and
``RUN_DIR/alerts.jsonl``.

An *episode* is a stretch of logging steps during which a condition holds: the alarm is printed and appended once,
when the episode starts; it re-arms when the condition has cleared at a later logging step. Episode keys:
``(dead_expert, layer, expert)`` (a newly dead expert in a layer that already has dead ones is a new alarm),
``(collapse, layer)``, ``(token_drop, layer)``, ``(loss_spike,)`` and ``(nonfinite_loss,)``.

Each ``alerts.jsonl`` line is a JSON object: ``step``, ``kind``, ``layer`` (transformer-block index or ``null``),
``experts`` (list), ``value``, ``threshold``, ``message``, ``remedy``, ``fatal``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moetrain.errors import MoetrainError
from moetrain.runtime.oserrors import writing
from moetrain.train.metrics import json_line, read_records
from moetrain.train.monitor_config import MonitorConfig
from moetrain.train.routing_stats import Snapshot

ALERTS_FILE = "alerts.jsonl"

REMEDIES = {
    "dead_expert": "raise model.moe.losses.aux_loss_coeff (load balancing), lower train.lr or lengthen "
                   "train.warmup_steps, and check the router initialisation",
    "collapse": "raise model.moe.losses.aux_loss_coeff (load balancing) and model.moe.losses.z_loss_coeff, "
                "lower train.lr",
    "token_drop": "raise the capacity factor (or train dropless) and model.moe.losses.aux_loss_coeff to even out "
                  "the load",
    "loss_spike": "lower train.lr or lengthen train.warmup_steps, lower train.grad_clip, raise "
                  "model.moe.losses.z_loss_coeff; if it persists, resume from a checkpoint before the spike",
    "nonfinite_loss": "lower train.lr, raise model.moe.losses.z_loss_coeff (keeps router logits small), lower "
                      "train.grad_clip, and resume from the last good checkpoint",
}


@dataclass(frozen=True)
class Alert:
    """One alarm. ``layer`` is the transformer-block index (``None`` for run-wide alarms); ``value`` is the
    measured quantity the ``threshold`` applies to."""

    step: int
    kind: str
    layer: int | None
    experts: tuple[int, ...]
    value: float
    threshold: float
    message: str
    remedy: str
    fatal: bool = False

    def line(self) -> str:
        """The one line printed to the console."""
        return f"ALARM [{self.kind}] step {self.step}: {self.message}. Remedy: {self.remedy}."


class TrainingAlarm(MoetrainError):
    """A fatal alarm (``monitor.fatal``) stopped training; the CLI prints the message and exits with status 2."""

    def __init__(self, alert: Alert, note: str = ""):
        super().__init__(f"monitor.fatal: training stopped by the {alert.kind} alarm at step {alert.step}: "
                         f"{alert.message}. Remedy: {alert.remedy}.{note}")
        self.alert = alert


def _experts(ids: list[int]) -> str:
    return ("expert " if len(ids) == 1 else "experts ") + ", ".join(str(i) for i in ids)


def _alert(config: MonitorConfig, step: int, kind: str, layer: int | None, experts: list[int], value: float,
           threshold: float, message: str) -> Alert:
    return Alert(step=step, kind=kind, layer=layer, experts=tuple(experts), value=float(value),
                 threshold=float(threshold), message=message, remedy=REMEDIES[kind], fatal=kind in config.fatal)


def dead_alert(step: int, layer: int, experts: list[int], idle: int, n_experts: int,
               config: MonitorConfig) -> Alert:
    """The dead-expert alarm for ``experts`` of ``layer``, idle for at least ``idle`` steps."""
    return _alert(config, step, "dead_expert", layer, experts, idle, config.dead_steps,
                  f"layer {layer}: {_experts(experts)} of {n_experts} received no tokens for {idle}+ consecutive "
                  f"steps (threshold monitor.dead_steps={config.dead_steps})")


# An alarm episode's key: (kind,) or (kind, layer) or (kind, layer, expert).
AlertKey = tuple[str | int, ...]


def evaluate_alarms(snap: Snapshot, config: MonitorConfig, top_k: int) -> dict[AlertKey, Alert]:
    """Every alarm condition that holds in ``snap``, keyed by episode key (see the module docstring).

    Args:
        snap: the interval's statistics.
        config: thresholds.
        top_k: K (collapse is not evaluated when K equals the number of experts).
    """
    out: dict[AlertKey, Alert] = {}
    span = f"steps {snap.first_step}-{snap.step}" if snap.steps > 1 else f"step {snap.step}"

    def add(key: AlertKey, kind: str, layer: int | None, experts: list[int], value: float, threshold: float,
            message: str) -> None:
        out[key] = _alert(config, snap.step, kind, layer, experts, value, threshold, message)

    for ls in snap.layers:
        n_experts = len(ls.tokens)
        for e, idle in enumerate(ls.idle):
            if idle >= config.dead_steps:
                out[("dead_expert", ls.layer, e)] = dead_alert(snap.step, ls.layer, [e], idle, n_experts, config)
        total = sum(ls.tokens)
        w_tok = sum(ls.window_tokens) / top_k  # tokens in the collapse window
        hot = [e for e, t in enumerate(ls.window_tokens) if w_tok > 0 and t / w_tok > config.collapse_fraction]
        # collapse_from_step None: the trainer sets it to train.warmup_steps; a monitor built directly checks from 0
        if top_k < n_experts and hot and snap.step >= (config.collapse_from_step or 0):
            shares = ", ".join(f"expert {e} {ls.window_tokens[e] / w_tok:.0%}" for e in hot)
            window = f"steps {snap.step - snap.window_steps + 1}-{snap.step}"
            add(("collapse", ls.layer), "collapse", ls.layer, hot, max(ls.window_tokens) / w_tok,
                config.collapse_fraction,
                f"layer {ls.layer}: routing collapse over {window}, share of the layer's tokens choosing {shares} "
                f"(threshold monitor.collapse_fraction={config.collapse_fraction:.0%} over monitor.collapse_window="
                f"{config.collapse_window} steps; balanced {top_k / n_experts:.0%})")
        if ls.drop_fraction is not None and ls.drop_fraction > config.drop_fraction:
            if ls.dropped is not None:  # per-expert drops reported: name the experts that dropped
                hot = [e for e, d in enumerate(ls.dropped) if d > 0]
                which = f"dropping: {_experts(hot)}"
            else:
                hot = [e for e, t in enumerate(ls.tokens) if t > total / n_experts]
                which = f"overloaded: {_experts(hot)}"
            add(("token_drop", ls.layer), "token_drop", ls.layer, hot, ls.drop_fraction, config.drop_fraction,
                f"layer {ls.layer}: {ls.drop_fraction:.1%} of token assignments dropped over {span} (threshold "
                f"monitor.drop_fraction={config.drop_fraction:.1%}); {which} (max/mean load {ls.overload:.2f})")
    if (config.spike_factor > 0 and snap.spike_ratio is not None and snap.spike_loss is not None
            and snap.spike_ratio > config.spike_factor):  # spike_loss is set with spike_ratio
        median = snap.spike_loss / snap.spike_ratio
        add(("loss_spike",), "loss_spike", None, [], snap.spike_ratio, config.spike_factor,
            f"loss spike at step {snap.spike_step}: LM loss {snap.spike_loss:.4f} is {snap.spike_ratio:.2f}x the "
            f"rolling median {median:.4f} (threshold monitor.spike_factor={config.spike_factor})")
    if snap.nonfinite_steps > 0:
        add(("nonfinite_loss",), "nonfinite_loss", None, [], snap.nonfinite_steps, 0,
            f"non-finite LM loss at step {snap.nonfinite_step} ({snap.nonfinite_steps} of the {snap.steps} steps in "
            f"{span})")
    return out


class AlertTracker:
    """Turns conditions into episodes: prints each new alarm once through ``log`` and appends it to ``path``.

    Args:
        config: thresholds and fatal kinds.
        path: ``RUN_DIR/alerts.jsonl`` (appended; created on the first alarm).
        top_k: K of the MoE layers.
        log: where the alarm lines go (the trainer's console log).
    """

    def __init__(self, config: MonitorConfig, path: Path, top_k: int, log: Callable[[str], None] = print):
        self.config, self.path, self.top_k, self.log = config, path, top_k, log
        self.active: set[AlertKey] = set()
        self.fatal: Alert | None = None

    def update(self, snap: Snapshot) -> list[Alert]:
        """Evaluate ``snap``; returns the alarms that start an episode at this step (already printed and written).
        The first new fatal one is kept in :attr:`fatal`."""
        current = evaluate_alarms(snap, self.config, self.top_k)
        new: list[Alert] = []
        dead: dict[int, list[Alert]] = {}  # newly dead experts, grouped into one alarm per layer
        for key, alert in current.items():
            if key in self.active:
                continue
            if alert.kind == "dead_expert":
                assert alert.layer is not None  # a dead expert's alarm names its layer
                dead.setdefault(alert.layer, []).append(alert)
            else:
                new.append(alert)
        n_experts = {ls.layer: len(ls.tokens) for ls in snap.layers}
        new = [dead_alert(snap.step, layer, sorted(e for a in group for e in a.experts),
                          int(min(a.value for a in group)), n_experts[layer], self.config)
               for layer, group in dead.items()] + new
        self.active = set(current)
        if new:
            # a full disk fails the buffered write with an errno but no file name: name the file here
            with writing("the alarm log", self.path), open(self.path, "a") as f:
                for alert in new:
                    f.write(json_line(asdict(alert)))  # experts: a JSON list
        for alert in new:
            self.log(alert.line())
            if alert.fatal and self.fatal is None:
                self.fatal = alert
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"active": sorted(self.active, key=repr)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A fatal kind's episode is not restored: one that still holds stops the resumed run again, so a restart
        # loop never trains on through an alarm it was told to stop at (drop the kind from monitor.fatal to go on).
        self.active = {tuple(k) for k in state.get("active", []) if k[0] not in self.config.fatal}


def read_alerts(run_dir: Path) -> list[dict[str, Any]]:
    """The alarms of a run (``[]`` if none), skipping a partial last line of a run in progress."""
    return read_records(Path(run_dir) / ALERTS_FILE)[0]
