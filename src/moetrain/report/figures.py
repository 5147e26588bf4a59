"""PNG figures of a run with matplotlib's Agg backend (no display needed): loss and learning rate, expert load per
layer over steps, dropped-token fraction, and routing-health curves; alarms are marked on each.

Every figure is written even when its data is missing (a run in progress): the axes then say what is missing
instead of being blank. The one exception is the dropped-token figure of a dropless run (no capacity), which can
only ever be zero: it is not written (:func:`figures_for`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from moetrain.errors import MoetrainError
from moetrain.report.runlog import RunLog

# One colour per alarm kind, shared by every figure's markers and legend.
ALARM_COLORS = {"dead_expert": "tab:purple", "collapse": "tab:red", "token_drop": "tab:orange",
                "loss_spike": "tab:brown", "nonfinite_loss": "black"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MoetrainError("moetrain report needs matplotlib, a dependency of moetrain that is missing from this "
                            "environment: pip install matplotlib (or reinstall moetrain: pip install -e .)") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _mark_alarms(ax, alerts: list[dict[str, Any]], layer: int | None = None) -> None:
    """Vertical lines at alarm steps (only ``layer``'s and run-wide ones when ``layer`` is given), one legend entry
    per kind."""
    seen = set()
    for a in alerts:
        if layer is not None and a.get("layer") not in (None, layer):
            continue
        kind = a.get("kind", "?")
        ax.axvline(a.get("step", 0), color=ALARM_COLORS.get(kind, "gray"), linestyle="--", linewidth=1, alpha=0.8,
                   label=f"alarm: {kind}" if kind not in seen else None)
        seen.add(kind)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _legend(ax, **kwargs) -> None:
    """A legend only where something is labelled (an empty one is a warning and a box)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _save(plt, fig, path: Path, tight: bool = True) -> Path:
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def loss_lr_figure(log: RunLog, path: Path) -> Path:
    """Train / validation loss (left axis) and learning rate (right axis) over steps."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        steps, values = log.series(key)
        if values:
            ax.plot(steps, values, style, label=key.replace("_", " "), markersize=4)
    steps, lrs = log.series("lr")
    handles, labels = [], []
    if lrs:
        ax2 = ax.twinx()
        ax2.plot(steps, lrs, color="tab:green", alpha=0.6, label="learning rate")
        ax2.set_ylabel("learning rate")
        handles, labels = ax2.get_legend_handles_labels()
    if not log.series("train_loss")[1] and not log.series("val_loss")[1]:
        _empty(ax, "no losses logged yet")
    _mark_alarms(ax, log.alerts)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="Loss and learning rate")
    h, lab = ax.get_legend_handles_labels()
    if h or handles:
        ax.legend(h + handles, lab + labels, loc="upper right", fontsize=8)
    return _save(plt, fig, path)


def expert_load_figure(log: RunLog, path: Path) -> Path:
    """One heatmap per MoE layer: experts (rows) x logging steps (columns), colour = the expert's load relative to
    the balanced share: (fraction of the layer's tokens that chose it in that interval) / (K / E). A diverging
    scale centred on 1 (white = balanced, red = overloaded, blue = underused) shows the differences around the
    balanced share that a 0-1 scale hides; the colour bar marks the balanced reference."""
    from matplotlib.colors import TwoSlopeNorm

    plt = _pyplot()
    layers = log.layers()
    k = log.top_k()
    fig, axes = plt.subplots(max(len(layers), 1), 1, figsize=(9, 1.2 + 2.2 * max(len(layers), 1)), squeeze=False,
                             layout="constrained")
    mesh, top = None, 2.0
    for ax, layer in zip(axes[:, 0], layers):
        steps, tokens = log.series(f"moe/layer{layer}/tokens")
        pairs = [(s, t) for s, t in zip(steps, tokens) if isinstance(t, list) and t and sum(t) > 0]
        if not pairs:
            _empty(ax, f"layer {layer}: no token counts logged")
            continue
        n_experts = max(len(t) for _, t in pairs)
        pairs = [(s, t) for s, t in pairs if len(t) == n_experts]
        # share of tokens / balanced share K / E: 1 = balanced  [E, n_logs]
        grid = [[t[e] / (sum(t) / k) / (k / n_experts) for _, t in pairs] for e in range(n_experts)]
        top = max(top, max(max(row) for row in grid))
        # Column i covers the logging interval (step_{i-1}, step_i]; the first one starts interval_steps earlier.
        first = next((r.get("moe/interval_steps") for r in log.records if r["step"] == pairs[0][0]), None) or 1
        x_edges = [pairs[0][0] - first] + [s for s, _ in pairs]
        mesh = ax.pcolormesh(x_edges, [e - 0.5 for e in range(n_experts + 1)], grid, cmap="RdBu_r",
                             norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=2.0))
        ax.set_ylabel(f"layer {layer}\nexpert")
        if n_experts <= 16:
            ax.set_yticks(range(n_experts))
        _mark_alarms(ax, log.alerts, layer)
        _legend(ax, loc="upper right", fontsize=7)
    if not layers:
        _empty(axes[0, 0], "no routing statistics logged")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("Expert load relative to the balanced share K / E (1 = balanced)")
    if mesh is not None:
        for m in (c for ax in axes[:, 0] for c in ax.collections):  # one scale for all layers
            m.set_norm(TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top))
        bar = fig.colorbar(mesh, ax=axes[:, 0].tolist(), fraction=0.03, pad=0.01,
                           label="load / balanced share (0 = unused)")
        bar.ax.axhline(1.0, color="black", linewidth=1.5)
        # The balanced reference is a tick of its own, labelled in place (a separate text overlapped the tick 1.0).
        ticks = sorted({float(t) for t in bar.get_ticks() if 0.0 <= t <= top and abs(t - 1.0) > 0.15 * top} | {1.0})
        bar.set_ticks(ticks, labels=["1 balanced" if t == 1.0 else f"{t:g}" for t in ticks])
    return _save(plt, fig, path, tight=False)  # constrained layout


def drop_figure(log: RunLog, path: Path) -> Path:
    """Dropped-token fraction per MoE layer over steps (the axis starts at 0). A capacity that was never exceeded
    shows its zeros, with a note; a dropless run gets no such figure (:func:`figures_for`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    dropped = False
    for layer in log.layers():
        steps, values = log.series(f"moe/layer{layer}/drop_fraction")
        if values:
            ax.plot(steps, [100 * v for v in values], marker=".", label=f"layer {layer}")
            dropped = dropped or any(isinstance(v, (int, float)) and v > 0 for v in values)
    if not ax.lines:
        _empty(ax, "no drop fractions logged yet")
    elif not dropped:
        ax.set_ylim(0, 1)
        _empty(ax, "nothing dropped: no expert received more tokens than its capacity")
    else:
        ax.set_ylim(bottom=0)
    _mark_alarms(ax, [a for a in log.alerts if a.get("kind") == "token_drop"])
    ax.set(xlabel="step", ylabel="dropped assignments (%)", title="Dropped-token fraction")
    _legend(ax, fontsize=8)
    return _save(plt, fig, path)


def routing_health_figure(log: RunLog, path: Path) -> Path:
    """Load CV, max share, router entropy and mean router z per layer over steps."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    panels = [("cv", "load coefficient of variation"), ("max_share", "max share of tokens"),
              ("entropy", "router entropy (nats)"), ("router_z", "mean router z (logsumexp)")]
    n_experts = log.num_experts()
    for ax, (stat, title) in zip(axes.flat, panels):
        for layer in log.layers():
            steps, values = log.series(f"moe/layer{layer}/{stat}")
            if values:
                ax.plot(steps, values, label=f"layer {layer}")
        if not ax.lines:
            _empty(ax, "not logged")
        elif stat == "entropy" and n_experts:  # the ceiling: a router that spreads every token evenly
            ax.axhline(math.log(n_experts), color="gray", linestyle=":", linewidth=1.2,
                       label=f"uniform: ln {n_experts} = {math.log(n_experts):.2f}")
        _mark_alarms(ax, log.alerts)
        ax.set_title(title, fontsize=10)
        _legend(ax, fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    return _save(plt, fig, path)


FIGURES = {
    "loss_lr.png": loss_lr_figure,
    "expert_load.png": expert_load_figure,
    "drop_fraction.png": drop_figure,
    "routing_health.png": routing_health_figure,
}


ROUTING_FIGURES = ("expert_load.png", "drop_fraction.png", "routing_health.png")
"""The figures of routing statistics, which a dense run (no MoE layer) does not log."""


def figures_for(log: RunLog) -> list[str]:
    """The names of :data:`FIGURES` that ``log`` gets: only ``loss_lr.png`` for a dense run, all but
    ``drop_fraction.png`` for a dropless one."""
    if not log.has_moe_layers():
        return [name for name in FIGURES if name not in ROUTING_FIGURES]
    return [name for name in FIGURES if not (name == "drop_fraction.png" and log.dropless())]


def write_figures(log: RunLog, out_dir: Path) -> list[Path]:
    """Write the figures of :func:`figures_for` into ``out_dir``; returns their paths.

    Raises:
        MoetrainError: matplotlib is not installed.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    return [FIGURES[name](log, out_dir / name) for name in figures_for(log)]
