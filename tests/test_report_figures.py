"""The report's and compare's figures show what they claim: the colour bar's balanced reference is a tick of its
own (no label over another), the routing-entropy panel has the uniform ceiling ln E, a dropless run gets no
dropped-token figure (a capacity run gets its zeros), and compare's curves start at step 0.

Figures are built from synthetic logs (no training) and inspected as matplotlib objects just before they close."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from moetrain.report.figures import FIGURES, figures_for, write_figures
from moetrain.report.runlog import RunLog


def _log(tmp_path: Path, capacity: float | None, drops: float = 0.0) -> RunLog:
    e, k = 4, 2
    config = {"model": {"moe": {"num_experts": e, "top_k": k, "capacity": {"factor": capacity}}}}
    records = []
    for step in (5, 10, 15):
        rec = {"step": step, "train_loss": 5.0 - step / 10, "lr": 1e-3, "moe/interval_steps": 5}
        for layer in (0, 1):
            tokens = [40 + 10 * layer, 30, 20, 10 - 5 * layer]  # K = 2 choices per token
            rec.update({f"moe/layer{layer}/tokens": tokens, f"moe/layer{layer}/cv": 0.4,
                        f"moe/layer{layer}/max_share": 0.5, f"moe/layer{layer}/entropy": 1.3 - 0.01 * step,
                        f"moe/layer{layer}/router_z": 1.0, f"moe/layer{layer}/drop_fraction": drops})
        records.append(rec)
    return RunLog(tmp_path, config, records)


@pytest.fixture
def closed_figures(monkeypatch):
    """Every figure closed through pyplot, in order (the figure functions close what they save)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    seen = []
    real_close = plt.close

    def close(fig=None):
        seen.append(fig)
        real_close(fig)

    monkeypatch.setattr(plt, "close", close)
    return seen


def test_the_balanced_tick_has_its_own_label(tmp_path, closed_figures):
    from moetrain.report.figures import expert_load_figure

    expert_load_figure(_log(tmp_path, None), tmp_path / "load.png")
    fig = closed_figures[-1]
    bar_ax = fig.axes[-1]  # the colour bar, after the layers' axes
    fig.canvas.draw()
    labels = [t for t in bar_ax.get_yticklabels() if t.get_text()]
    assert "1 balanced" in [t.get_text() for t in labels]
    boxes = [t.get_window_extent() for t in labels]
    for i, a in enumerate(boxes):  # no two tick labels overlap
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), [t.get_text() for t in labels]
    assert not [t for t in bar_ax.texts if t.get_text() == "balanced"]  # no free text beside the bar's ticks


def test_the_entropy_panel_marks_uniform_routing(tmp_path, closed_figures):
    from moetrain.report.figures import routing_health_figure

    routing_health_figure(_log(tmp_path, None), tmp_path / "health.png")
    entropy_ax = closed_figures[-1].axes[2]
    assert "entropy" in entropy_ax.get_title()
    uniform = [line for line in entropy_ax.lines if line.get_label().startswith("uniform")]
    assert len(uniform) == 1 and list(uniform[0].get_ydata()) == [math.log(4)] * 2


def test_a_dropless_run_gets_no_drop_figure_and_a_capacity_run_does(tmp_path, closed_figures):
    dropless = _log(tmp_path, None)
    assert dropless.dropless() is True and "drop_fraction.png" not in figures_for(dropless)
    written = write_figures(dropless, tmp_path / "a")
    assert sorted(p.name for p in written) == sorted(set(FIGURES) - {"drop_fraction.png"})
    assert not (tmp_path / "a" / "drop_fraction.png").exists()

    capacity = _log(tmp_path, 1.25)  # a capacity never exceeded: its zeros are data, shown as such
    assert capacity.dropless() is False
    written = write_figures(capacity, tmp_path / "b")
    assert (tmp_path / "b" / "drop_fraction.png") in written
    drop_ax = next(f for f in closed_figures if f.axes[0].get_title() == "Dropped-token fraction").axes[0]
    assert [list(line.get_ydata()) for line in drop_ax.lines] == [[0.0, 0.0, 0.0]] * 2
    assert any("nothing dropped" in t.get_text() for t in drop_ax.texts)
    assert RunLog(tmp_path, None, []).dropless() is None  # unknown config: the figure is kept


@pytest.mark.parametrize("model, moe", [({"n_layers": 2, "moe_every": 0}, False),
                                        ({"n_layers": 2, "moe_every": 1, "first_k_dense": 2}, False),
                                        ({"n_layers": 4, "moe_every": 2, "first_k_dense": 2}, True),
                                        ({"n_layers": 2}, True), ({}, True)])
def test_a_dense_run_gets_the_loss_figure_only(tmp_path, closed_figures, model, moe):
    records = [{"step": s, "train_loss": 5.0 - s / 10, "lr": 1e-3} for s in (5, 10)]
    log = RunLog(tmp_path, {"model": model}, records)
    assert log.has_moe_layers() is moe
    if not moe:
        assert [p.name for p in write_figures(log, tmp_path / "f")] == ["loss_lr.png"]


def test_compare_curves_start_at_step_0(tmp_path, closed_figures):
    from moetrain.commands.compare import write_figures as compare_figures

    evals = [{"step": s, "tokens": 1000 * s, "seconds": 0.5 * s, "val_loss": loss}
             for s, loss in ((0, 6.2), (10, 4.0), (20, 3.5))]
    compare_figures(tmp_path, [{"variant": "moe", "seed": 0, "evals": evals}])
    for fig in closed_figures[-2:]:
        (line,) = fig.axes[0].lines
        assert list(line.get_ydata()) == [6.2, 4.0, 3.5]
        assert fig.axes[0].get_yscale() == "log"  # 6.2 / 3.5 > 1.5: the later differences stay visible
