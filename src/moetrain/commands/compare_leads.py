"""Leads of each variant of a ``moetrain compare`` over the first one (the baseline: list the dense twin first),
per token and at the same seconds, and the tokens/s ratio; how they are read and compared: docs/compare.md.
"""

from __future__ import annotations

from typing import Any

from moetrain.results import markdown_table


def loss_at_seconds(evals: list[dict[str, Any]], seconds: float) -> float | None:
    """Validation loss at ``seconds`` of training, linear between the evaluations around it.

    Args:
        evals: a run's ``evals`` of ``compare.json`` (``seconds`` ascending; the step-0 evaluation at 0 s).
        seconds: when, in seconds of the training loop.
    Returns:
        nats/token, or ``None`` when ``seconds`` lies outside the evaluated span (no extrapolation).
    """
    points = [(e["seconds"], e["val_loss"]) for e in evals if e["seconds"] is not None and e["val_loss"] is not None]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= seconds <= t1:
            return l1 if t1 == t0 else l0 + (l1 - l0) * (seconds - t0) / (t1 - t0)
    if points and points[-1][0] == seconds:  # a single evaluation
        return points[-1][1]
    return None


def _loss_by_tokens(run: dict[str, Any]) -> dict[int, float]:
    return {e["tokens"]: e["val_loss"] for e in run["evals"] if e["val_loss"] is not None}


def last_trained_eval(evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last evaluation after step 0 of a run's ``evals`` (the step-0 evaluation alone is no training), or
    ``None``: what a run's final loss and training seconds are read from."""
    return next((e for e in reversed(evals) if e["step"] > 0 and e["val_loss"] is not None), None)


def _failed(run: dict[str, Any]) -> str | None:
    code = run["exit_code"]
    return None if code == 0 else f"{run['variant']} failed (exit {code}): no lead"


def lead_rows(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (seed, variant other than the first), in the order of ``summaries``.

    Args:
        summaries: ``compare.json``'s ``runs`` (seed-major, variants in command-line order), each with its
            ``wave`` (``moetrain.commands.compare.plan_waves``) and ``exit_code``.
    Returns:
        dicts with ``variant``, ``seed``, ``baseline``, ``tokens`` (where the per-token lead is read),
        ``lead_per_token``, ``seconds`` (``t*``), ``lead_same_seconds``, ``speed_ratio``, ``same_wave`` and
        ``note`` (why a lead is missing or not comparable, or ``None``); ``None`` for what the runs cannot give.
    """
    if not summaries:
        return []
    baseline = summaries[0]["variant"]
    rows = []
    for seed in dict.fromkeys(s["seed"] for s in summaries):
        runs = [s for s in summaries if s["seed"] == seed]
        base = next((s for s in runs if s["variant"] == baseline), None)
        for s in runs:
            if s is base or base is None:
                continue
            same_wave = s["wave"] == base["wave"]
            row: dict[str, Any] = {"variant": s["variant"], "seed": seed, "baseline": baseline, "tokens": None,
                                   "lead_per_token": None, "seconds": None, "lead_same_seconds": None,
                                   "speed_ratio": None, "same_wave": same_wave,
                                   "note": None if same_wave else "another wave: seconds and tokens/s not comparable"}
            failed = _failed(base) or _failed(s)
            if failed:
                row["note"] = failed
                rows.append(row)
                continue
            base_by, var_by = _loss_by_tokens(base), _loss_by_tokens(s)
            common = (base_by.keys() & var_by.keys()) - {0}
            if common:
                row["tokens"] = max(common)
                row["lead_per_token"] = base_by[row["tokens"]] - var_by[row["tokens"]]
            last_base, last_var = last_trained_eval(base["evals"]), last_trained_eval(s["evals"])
            if last_base is not None and last_var is not None and None not in (last_base["seconds"],
                                                                                 last_var["seconds"]):
                t = min(last_base["seconds"], last_var["seconds"])
                lb, lv = loss_at_seconds(base["evals"], t), loss_at_seconds(s["evals"], t)
                row["seconds"] = t
                row["lead_same_seconds"] = None if lb is None or lv is None else lb - lv
            if base["median_tokens_per_s"] and s["median_tokens_per_s"]:
                row["speed_ratio"] = s["median_tokens_per_s"] / base["median_tokens_per_s"]
            rows.append(row)
    return rows


def num(value: float | None, fmt: str) -> str:
    """``value`` formatted with ``fmt``, ``-`` for ``None`` (a run without it)."""
    return "-" if value is None else format(value, fmt)


def leads_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown section for ``compare.md`` (empty when there is one variant)."""
    if not rows:
        return ""
    lines = [f"Leads over `{rows[0]['baseline']}`: its validation loss minus the variant's (positive: the variant "
             "is lower).", "",
             "- per token: at the most tokens both runs were evaluated at;",
             "- at the same seconds: at the earlier of the two runs' last evaluations (training-loop seconds, "
             "evaluations and checkpoints included), the other run's loss interpolated between its evaluations;",
             "- tokens/s ratio: the variant's median tokens/s over the baseline's.", ""]
    columns = ["variant", "seed", "tokens", "lead per token", "at seconds", "lead at the same seconds",
               "tokens/s ratio", "note"]
    lines += markdown_table(columns, [
        [r["variant"], r["seed"], num(r["tokens"], "d"), num(r["lead_per_token"], "+.3f"),
         num(r["seconds"], ".1f" if (r["seconds"] or 0) >= 1 else ".3f"), num(r["lead_same_seconds"], "+.3f"),
         num(r["speed_ratio"], ".2f"), r["note"] or ""] for r in rows])
    return "\n".join(lines)
