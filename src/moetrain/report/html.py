"""One self-contained HTML page per run: figures embedded as base64 ``data:`` URIs, inline CSS, no scripts and no
external resources (it opens offline and can be mailed as one file)."""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path

from moetrain.report.runlog import RunLog
from moetrain.report.table import HEADER, layer_rows, run_summary

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; } td, th { border: 1px solid #ccc; padding: 3px 7px; }
th { background: #f3f3f3; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin: 0.8em 0; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.8em; max-height: 30em; }
.alarm { color: #a00; } .muted { color: #777; }
"""


def _table(header: list[str] | None, rows: list[list[str]], numeric_from: int = 1) -> str:
    """An HTML table (no header row when ``header`` is ``None``); cells from column ``numeric_from`` on are
    right-aligned."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header or [])
    body = "".join(
        "<tr>" + "".join(
            f'<td class="num">{html.escape(str(c))}</td>' if i >= numeric_from else f"<td>{html.escape(str(c))}</td>"
            for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    thead = f"<thead><tr>{head}</tr></thead>" if header else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    alt = html.escape(path.stem.replace("_", " "))
    return f'<img alt="{alt}" src="data:image/png;base64,{data}">'


def render_html(log: RunLog, figures: list[Path]) -> str:
    """The report page of ``log`` with ``figures`` (PNG files) embedded."""
    name = html.escape(log.run_dir.resolve().name)
    summary = _table(None, [[k, v] for k, v in run_summary(log)], numeric_from=2)
    rows = layer_rows(log)
    layers = _table(HEADER, rows) if rows else '<p class="muted">No routing statistics logged yet.</p>'
    if log.alerts:
        alert_rows = [[a.get("step", ""), a.get("kind", ""), "-" if a.get("layer") is None else a["layer"],
                       ",".join(map(str, a.get("experts") or [])) or "-", a.get("message", ""), a.get("remedy", "")]
                      for a in log.alerts]
        alerts = _table(["step", "kind", "layer", "experts", "message", "remedy"], alert_rows, numeric_from=99)
    else:
        alerts = "<p>No alarms.</p>"
    config = ("(config.json not found)" if log.config is None
              else html.escape(json.dumps(log.config, indent=2), quote=False))
    images = "\n".join(_image(p) for p in figures)
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>moetrain report: {name}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>moetrain report: {name}</h1>
<p class="muted">Run directory {html.escape(str(log.run_dir))}; generated {generated}.</p>
<h2>Summary</h2>
{summary}
<h2>MoE layers (latest logging interval)</h2>
<p class="muted">Load per expert: share of the layer's tokens that chose each expert (balanced = top-k / experts).
cv: coefficient of variation of the load; max/mean: overload factor; dead: experts idle for monitor.dead_steps;
entropy and z: mean router entropy (nats) and logsumexp of the router logits.</p>
{layers}
<h2>Alarms</h2>
<div class="alarm">{alerts}</div>
<h2>Figures</h2>
{images}
<h2>Configuration</h2>
<pre>{config}</pre>
</body>
</html>
"""
