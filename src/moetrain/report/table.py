"""The per-layer routing table (latest logging interval), shared by ``moetrain stats`` and the HTML report."""

from __future__ import annotations

from collections import Counter
from typing import Any

from moetrain.report.runlog import RunLog

HEADER = ["layer", "step", "load per expert", "cv", "max/mean", "max share", "dead", "drop", "entropy", "z", "aux",
          "z-loss"]


def _num(value: Any, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _load(tokens: list[float] | None, top_k: int, max_listed: int = 16) -> str:
    """Share of the layer's tokens per expert, in %: each value listed for up to ``max_listed`` experts, else the
    range."""
    if not tokens or sum(tokens) <= 0:
        return "-"
    n_tok = sum(tokens) / top_k
    shares = [100 * t / n_tok for t in tokens]
    if len(shares) <= max_listed:
        return " ".join(f"{s:.0f}" for s in shares) + " %"
    return f"{min(shares):.1f}..{max(shares):.1f} % ({len(shares)} experts)"


def layer_rows(log: RunLog) -> list[list[str]]:
    """One row per MoE layer (see :data:`HEADER`) from the newest record holding that layer's statistics."""
    rows = []
    for layer in log.layers():
        step, s = log.layer_stats(layer)
        dead = s.get("dead")
        rows.append([
            str(layer), str(step), _load(s.get("tokens"), log.top_k()), _num(s.get("cv")),
            _num(s.get("overload"), ".2f"), _num(s.get("max_share"), ".2f"),
            "-" if dead is None else (",".join(map(str, dead)) if dead else "0"),
            "-" if s.get("drop_fraction") is None else f"{100 * s['drop_fraction']:.1f}%",
            _num(s.get("entropy")), _num(s.get("router_z")), _num(s.get("aux_loss")), _num(s.get("z_loss")),
        ])
    return rows


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Plain-text table with columns padded to their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def monitor_enabled(log: RunLog) -> bool:
    """Whether the run's routing monitor was on (``monitor.enabled``; true when the config does not say)."""
    return ((log.config or {}).get("monitor") or {}).get("enabled", True) is not False


def run_summary(log: RunLog) -> list[tuple[str, str]]:
    """(label, value) pairs summarising the run: steps, losses, learning rate, throughput, alarms."""
    out: list[tuple[str, str]] = []
    cfg = log.config or {}
    total = (cfg.get("train") or {}).get("steps")
    last_step = max((r["step"] for r in log.records), default=None)
    out.append(("steps logged", f"{'none' if last_step is None else last_step}" + (f" of {total}" if total else "")))
    step, loss = log.latest("train_loss")
    if loss is not None:
        out.append(("train loss", f"{loss:.4f} (step {step})"))
    val_steps, vals = log.series("val_loss")
    if vals:
        out.append(("val loss", f"{vals[0]:.4f} (step {val_steps[0]}) -> {vals[-1]:.4f} (step {val_steps[-1]})"))
    step, lr = log.latest("lr")
    if lr is not None:
        out.append(("learning rate", f"{lr:.3g} (step {step})"))
    _, tps = log.series("tokens_per_s")
    if tps:
        out.append(("tokens/s (median)", f"{sorted(tps)[len(tps) // 2]:.0f}"))
    kinds = Counter(a.get("kind", "?") for a in log.alerts)
    alarms = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) if kinds else "none"
    if not kinds and not monitor_enabled(log):
        alarms = "not evaluated (monitor.enabled=false)"
    out.append(("alarms", alarms))
    if log.skipped_lines:
        out.append(("unreadable metrics lines", f"{log.skipped_lines} (a run in progress may end with a partial line)"))
    return out
