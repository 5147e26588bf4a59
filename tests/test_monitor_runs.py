"""Routing health on real `tiny` runs: a healthy run raises no alarm; a run whose router is forced to collapse
raises the collapse and dead-expert alarms within the configured window (also across a resume); a fatal alarm
stops the run with a checkpoint and exit status 2; `moetrain report` / `moetrain stats` on the finished run; the
HTML opens in headless Chromium without console errors (skipped where Chromium is absent)."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from conftest import sample_text
from moetrain.cli import main
from moetrain.config import build_config
from moetrain.parallel import meta_init
from moetrain.train.alerts import read_alerts
from moetrain.train.trainer import Trainer

# Same thresholds for the healthy and the collapsed run: the defaults, except dead_steps, shortened so that a 30-step
# run can show a dead expert. (tiny's healthy routing sends all tokens of a few steps in a row to the same experts,
# idling others for up to ~8 steps; the default collapse window of 20 steps averages such bursts out.)
MONITOR = {"dead_steps": 20}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 300 kB of tinyshakespeare (enough for 30 tiny steps, and quick to tokenize)."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(sample_text(300_000))
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def tiny_config(corpus: Path, cache_dir: Path, **sections):
    overrides = {"data": {"path": str(corpus), "cache_dir": str(cache_dir)}, "monitor": dict(MONITOR)}
    for name, values in sections.items():
        overrides[name] = {**overrides.get(name, {}), **values}
    return build_config("tiny", overrides=overrides)


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory, corpus, cache_dir) -> tuple[Path, list[str]]:
    run_dir = tmp_path_factory.mktemp("runs") / "healthy"
    lines: list[str] = []
    Trainer(tiny_config(corpus, cache_dir), run_dir, log=lines.append, progress=False).run()
    return run_dir, lines


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# A router forced to collapse: DeepSeek-style selection bias (it changes which experts are chosen, never the gating
# weights), frozen (update rate 0), and set to +100 on experts 0 and 1 by the initialisation below.
COLLAPSE_MOE = {"router": {"expert_bias": True, "expert_bias_update_rate": 0.0}}


@pytest.fixture
def forced_collapse(monkeypatch):
    """Initialise every model with a +100 selection bias on experts 0 and 1 of each MoE layer, so that every token
    chooses experts 0 and 1 (top-2 of 4) whatever its router logits."""
    original = meta_init.init_parameters  # every layout's initialisation, one process included

    @torch.no_grad()
    def collapsed(model, *args, **kwargs):
        original(model, *args, **kwargs)
        for layer in model.moe_layers():
            layer.router.e_score_correction_bias[:2] = 100.0

    monkeypatch.setattr(meta_init, "init_parameters", collapsed)


def test_healthy_tiny_run_raises_no_alarm(healthy_run):
    run_dir, lines = healthy_run
    assert read_alerts(run_dir) == []
    assert not any("ALARM" in line for line in lines)
    logged = [r for r in records(run_dir) if "moe/layer0/tokens" in r]
    assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30]
    cfg = build_config("tiny")
    for r in logged:
        # Every real token picks K experts: the counts of an interval sum to steps * batch * seq_len * K.
        want = r["moe/interval_steps"] * cfg.train.batch_size * cfg.data.seq_len * cfg.model.moe.top_k
        for layer in (0, 1):
            assert sum(r[f"moe/layer{layer}/tokens"]) == want
            assert r[f"moe/layer{layer}/n_dead"] == 0
            assert 0 < r[f"moe/layer{layer}/entropy"] <= torch.log(torch.tensor(4.0)).item() + 1e-6


def test_forced_collapse_raises_collapse_and_dead_alarms_in_window(tmp_path, corpus, cache_dir, forced_collapse):
    run_dir = tmp_path / "collapsed"
    cfg = tiny_config(corpus, cache_dir, model={"moe": COLLAPSE_MOE})
    lines: list[str] = []
    # Stop after step 12 and resume: alarm episodes and idle counters survive the checkpoint.
    Trainer(cfg, run_dir, log=lines.append, progress=False).run(stop_at_step=12)
    Trainer(cfg, run_dir, resume=True, log=lines.append, progress=False).run()
    alerts = read_alerts(run_dir)
    got = sorted((a["kind"], a["layer"], a["step"], tuple(a["experts"])) for a in alerts)
    # Collapse shows at the first logging step (5); experts 2 and 3 have had no token for dead_steps=20 steps at
    # step 20. Each alarm is raised once per layer although both conditions persist to step 30.
    assert got == [("collapse", 0, 5, (0, 1)), ("collapse", 1, 5, (0, 1)),
                   ("dead_expert", 0, 20, (2, 3)), ("dead_expert", 1, 20, (2, 3))]
    assert sum("ALARM [collapse]" in line for line in lines) == 2
    assert sum("ALARM [dead_expert]" in line for line in lines) == 2
    for a in alerts:
        assert a["remedy"] and f"layer {a['layer']}" in a["message"]
    last = records(run_dir)[-1]
    assert last["step"] == 30 and last["moe/layer1/dead"] == [2, 3] and last["moe/layer1/max_share_window"] == 1.0
    assert last["moe/layer1/bias"] == [100.0, 100.0, 0.0, 0.0]


@pytest.mark.parametrize(("monitor", "first"), [({}, 15), ({"collapse_from_step": 0}, 5)])
def test_collapse_alarm_waits_for_the_warmup(tmp_path, corpus, cache_dir, forced_collapse, monitor, first):
    # A 12-step warm-up: by default (collapse_from_step null) the collapse, present from step 1, is first reported
    # at the first logging step from step 12 on (15); collapse_from_step=0 reports it at the first logging step.
    cfg = tiny_config(corpus, cache_dir, model={"moe": COLLAPSE_MOE}, train={"warmup_steps": 12, "steps": 20},
                      monitor=monitor)
    Trainer(cfg, tmp_path / "run", log=lambda m: None, progress=False).run()
    steps = sorted({a["step"] for a in read_alerts(tmp_path / "run") if a["kind"] == "collapse"})
    assert steps == [first]


def test_fatal_collapse_exits_2_with_a_checkpoint(tmp_path, corpus, cache_dir, forced_collapse, capsys):
    run_dir = tmp_path / "fatal"
    rc = main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run_dir), "--no-progress",
               f"data.cache_dir={cache_dir}", "train.steps=12", 'monitor.fatal=["collapse"]',
               *(f"model.moe.router.{k}={str(v).lower()}" for k, v in COLLAPSE_MOE["router"].items())])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("moetrain: error: monitor.fatal:") and "collapse" in err[0]
    assert (run_dir / "checkpoints" / "step_00000005").is_dir()
    assert max(r["step"] for r in records(run_dir)) == 5


class _Resources(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v is not None]


@pytest.fixture(scope="module")
def report_dir(healthy_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    assert main(["report", str(healthy_run[0]), "--out", str(out)]) == 0
    return out


def test_report_on_a_finished_run(report_dir):
    out = report_dir
    pngs = sorted(out.glob("*.png"))
    # tiny is dropless (no capacity): no drop-fraction figure, which could only show zeros
    assert [p.name for p in pngs] == ["expert_load.png", "loss_lr.png", "routing_health.png"]
    for p in pngs:
        assert p.read_bytes().startswith(PNG) and p.stat().st_size > 5000
    page = (out / "report.html").read_text()
    parser = _Resources()
    parser.feed(page)
    # Self-contained: every resource is a data URI, the images are exactly the PNG files, no scripts.
    assert all(u.startswith("data:") for u in parser.urls)
    embedded = sorted(base64.b64decode(u.split(",", 1)[1]) for u in parser.urls if u.startswith("data:image/png"))
    assert embedded == sorted(p.read_bytes() for p in pngs)
    assert "script" not in parser.tags
    # The configuration and the per-layer table are on the page.
    assert '"num_experts": 4' in page and "<td>0</td>" in page and "<td>1</td>" in page


def test_stats_prints_the_latest_per_layer_table(healthy_run, capsys):
    run_dir, _ = healthy_run
    assert main(["stats", str(run_dir)]) == 0
    out = capsys.readouterr().out
    last = [r for r in records(run_dir) if "moe/layer0/cv" in r][-1]
    for layer in (0, 1):
        row = next(line for line in out.splitlines() if re.match(rf"^{layer}\s+30\s", line))
        assert f"{last[f'moe/layer{layer}/cv']:.3f}" in row
        assert f"{last[f'moe/layer{layer}/entropy']:.3f}" in row
    assert "alarms: none" in out


def test_report_and_stats_on_a_run_in_progress(healthy_run, tmp_path, capsys):
    run_dir, _ = healthy_run
    partial = tmp_path / "partial"
    partial.mkdir()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (partial / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])
    (partial / "config.json").write_text((run_dir / "config.json").read_text())
    assert main(["report", str(partial)]) == 0
    assert (partial / "report" / "report.html").is_file()
    assert main(["stats", str(partial)]) == 0
    assert "unreadable metrics lines: 1" in capsys.readouterr().out
    assert main(["stats", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_report_html_has_no_console_errors_in_headless_chromium(report_dir, tmp_path):
    from _chromium import find_chromium, page_errors

    chrome = find_chromium()
    if chrome is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    images_ok = "Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)"
    errors, ok = page_errors(chrome, (report_dir / "report.html").as_uri(), images_ok)
    assert errors == [] and ok is True
    # Control: the same check does see errors on a page that has them.
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><link rel="icon" href="data:,"></head><body>'
                   '<script>console.error("deliberate")</script><img src="missing.png"></body></html>')
    errors, _ = page_errors(chrome, bad.as_uri())
    assert any("deliberate" in e for e in errors) and any("missing.png" in e for e in errors)


def test_counts_exclude_the_global_aux_loss_routing_prepass(tmp_path, corpus, cache_dir):
    """With the global-batch aux loss and gradient accumulation, the trainer runs a no-grad routing pre-pass over
    the step's micro-batches; the monitor must count each training token once, not twice."""
    cfg = tiny_config(corpus, cache_dir, train={"steps": 5, "grad_accum": 2, "log_every": 5, "eval_every": 0},
                      model={"moe": {"num_experts": 4, "top_k": 2, "experts": {"ffn_hidden": 64},
                                     "losses": {"global_aux_loss_coeff": 0.01}}})
    run_dir = tmp_path / "global"
    Trainer(cfg, run_dir, log=lambda m: None, progress=False).run()
    (r,) = [r for r in records(run_dir) if "moe/layer0/tokens" in r]
    want = 5 * 2 * cfg.train.batch_size * cfg.data.seq_len * cfg.model.moe.top_k
    assert sum(r["moe/layer0/tokens"]) == want
