"""Run reports: PNG figures and one self-contained HTML page from a run directory's logs (``moetrain report``),
and the per-layer routing table (``moetrain stats``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moetrain.report.runlog import RunLog, load_run_log


@dataclass
class Report:
    """What :func:`build_report` wrote: the figures and the HTML page."""

    figures: list[Path]
    html: Path


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write the figures and ``report.html`` of ``run_dir`` into ``out_dir`` (default ``RUN_DIR/report``).

    Works on a run in progress (a partial last ``metrics.jsonl`` line is skipped).

    Raises:
        MoetrainError: not a run directory, or matplotlib missing.
    """
    from moetrain.report.figures import write_figures
    from moetrain.report.html import render_html

    log = load_run_log(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    figures = write_figures(log, out)
    (out / "report.html").write_text(render_html(log, figures), encoding="utf-8")
    return Report(figures=figures, html=out / "report.html")


__all__ = ["Report", "RunLog", "build_report", "load_run_log"]
