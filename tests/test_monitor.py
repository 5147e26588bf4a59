"""Routing-health monitor: statistics against hand-computed values on crafted routings, alarm episodes,
alerts.jsonl, fatal alarms, TensorBoard output and checkpoint state (no training; each test runs in well under a
second)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from moetrain.config import build_config
from moetrain.errors import ConfigError, MoetrainError
from moetrain.moe.config import CapacityConfig, ExpertsConfig, MoEConfig, RouterConfig
from moetrain.moe.layer import MoELayer
from moetrain.train.alerts import ALERTS_FILE, AlertTracker, TrainingAlarm, read_alerts
from moetrain.train.monitor import RoutingMonitor, colorize
from moetrain.train.monitor_config import MonitorConfig
from moetrain.train.routing_stats import RoutingStats, entropy_and_z_sums, load_statistics

# Router logits of 6 tokens over 4 experts (the router weight is the identity, so logits = inputs).
X = [
    [3.0, 2.0, 0.0, 0.0],
    [3.0, 0.0, 2.0, 0.0],
    [0.0, 1.0, 0.0, 5.0],
    [4.0, 3.0, 0.0, 0.0],
    [0.0, 0.0, 2.0, 3.0],
    [1.0, 0.0, 0.0, 0.0],  # ties among experts 1-3: the lowest index (1) wins
]
ONLY_01 = [[3.0, 2.0, 0.0, 0.0]] * 6  # every token picks experts 0 and 1


def hand_top2(rows: list[list[float]]) -> list[int]:
    """Assignments per expert of top-2 routing, by sorting each row (ties: lowest index first)."""
    counts = [0] * len(rows[0])
    for row in rows:
        for e in sorted(range(len(row)), key=lambda i: (-row[i], i))[:2]:
            counts[e] += 1
    return counts


def hand_entropy_z(rows: list[list[float]]) -> tuple[float, float]:
    """Mean entropy (nats) of softmax(row) and mean logsumexp(row), with plain floats."""
    hs, zs = [], []
    for row in rows:
        z = math.log(sum(math.exp(v) for v in row))
        p = [math.exp(v - z) for v in row]
        hs.append(-sum(q * math.log(q) for q in p))
        zs.append(z)
    return sum(hs) / len(hs), sum(zs) / len(zs)


class _Block(nn.Module):
    def __init__(self, ffn: nn.Module, is_moe: bool):
        super().__init__()
        self.ffn, self.is_moe = ffn, is_moe


def make_model(**moe_overrides) -> tuple[nn.Module, MoELayer]:
    """A two-block stand-in model: block 0 dense, block 1 an MoE layer (E=4, K=2) whose router logits equal its
    input."""
    layer = MoELayer(4, MoEConfig(num_experts=4, top_k=2, experts=ExpertsConfig(ffn_hidden=8), **moe_overrides))
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
    model = nn.Module()
    model.blocks = nn.ModuleList([_Block(nn.Identity(), False), _Block(layer, True)])
    return model, layer


def routing_entropy_and_z(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The means over the T tokens of ``entropy_and_z_sums``."""
    return tuple(s / logits.shape[0] for s in entropy_and_z_sums(logits))


def test_entropy_and_z_equal_hand_computation():
    h, z = routing_entropy_and_z(torch.tensor(X))
    want_h, want_z = hand_entropy_z(X)
    assert float(h) == pytest.approx(want_h, rel=1e-6)
    assert float(z) == pytest.approx(want_z, rel=1e-6)
    # Uniform logits: entropy ln E, z = c + ln E.
    h, z = routing_entropy_and_z(torch.full((3, 8), 2.0))
    assert float(h) == pytest.approx(math.log(8), rel=1e-6)
    assert float(z) == pytest.approx(2.0 + math.log(8), rel=1e-6)


def test_load_statistics_equal_hand_computation():
    tokens = [8.0, 8.0, 4.0, 4.0]
    s = load_statistics(tokens, top_k=2)
    assert s["cv"] == pytest.approx(statistics.pstdev(tokens) / statistics.mean(tokens))
    assert s["overload"] == pytest.approx(8 / 6)
    assert s["max_share"] == pytest.approx(8 / 12)  # 12 tokens chose 2 experts each
    assert load_statistics([0.0, 0.0], top_k=1) == {"cv": None, "overload": None, "max_share": None}


def test_crafted_routing_through_a_real_moe_layer(tmp_path):
    model, layer = make_model()
    monitor = RoutingMonitor(model, MonitorConfig(dead_steps=3), tmp_path, log=lambda m: None)
    layer.train()
    x = torch.tensor(X)
    outs = [layer(x)[1], layer(x.flip(0))[1]]  # two micro-batches of one step
    layer.eval()
    layer(torch.tensor(ONLY_01))  # evaluation forwards must not count
    monitor.end_step(1, torch.tensor(2.0))
    rec = monitor.flush(1)

    counts = hand_top2(X)
    assert counts == [4, 4, 2, 2]
    assert rec["moe/layer1/tokens"] == [2 * c for c in counts]
    doubled = [2.0 * c for c in counts]
    assert rec["moe/layer1/cv"] == pytest.approx(statistics.pstdev(doubled) / statistics.mean(doubled))
    assert rec["moe/layer1/overload"] == pytest.approx(max(doubled) / statistics.mean(doubled))
    assert rec["moe/layer1/max_share"] == pytest.approx(max(doubled) / (sum(doubled) / 2))
    want_h, want_z = hand_entropy_z(X)
    assert rec["moe/layer1/entropy"] == pytest.approx(want_h, rel=1e-6)
    assert rec["moe/layer1/router_z"] == pytest.approx(want_z, rel=1e-6)
    # Each loss term is the mean over the step's micro-batches of the layer's own record.
    for name in ("aux_loss", "z_loss"):
        want = sum(float(getattr(o, name).detach()) for o in outs) / 2
        assert rec[f"moe/layer1/{name}"] == pytest.approx(want, rel=1e-6)
    assert rec["moe/layer1/dead"] == [] and rec["moe/layer1/n_dead"] == 0
    assert rec["moe/interval_steps"] == 1
    assert not any(k.startswith("moe/layer0/") for k in rec)  # block 0 is dense

    # A second interval starts from zero.
    layer.train()
    layer(torch.tensor(ONLY_01))
    monitor.end_step(2, torch.tensor(2.0))
    rec = monitor.flush(2)
    assert rec["moe/layer1/tokens"] == hand_top2(ONLY_01) == [6, 6, 0, 0]
    monitor.close()
    layer(x)  # hooks detached: nothing is recorded any more
    monitor.end_step(3, torch.tensor(2.0))
    assert monitor.stats.counts.sum().item() == 0


def test_dead_expert_alarm_fires_once_per_episode_and_rearms(tmp_path):
    model, layer = make_model()
    lines: list[str] = []
    # collapse_fraction=1.0 never fires, so only the dead-expert alarm is under test.
    monitor = RoutingMonitor(model, MonitorConfig(dead_steps=3, collapse_fraction=1.0), tmp_path, log=lines.append)
    layer.train()
    # step: routing; experts 2 and 3 are idle from step 2 to 4 (3 steps) -> dead at step 4.
    plan = {1: X, 2: ONLY_01, 3: ONLY_01, 4: ONLY_01, 5: ONLY_01, 6: X, 7: ONLY_01, 8: ONLY_01, 9: ONLY_01}
    dead_by_step = {}
    for step, rows in plan.items():
        layer(torch.tensor(rows))
        monitor.end_step(step, torch.tensor(1.0))
        dead_by_step[step] = monitor.flush(step)["moe/layer1/dead"]
    assert dead_by_step == {1: [], 2: [], 3: [], 4: [2, 3], 5: [2, 3], 6: [], 7: [], 8: [], 9: [2, 3]}
    alerts = read_alerts(tmp_path)
    assert [(a["step"], a["kind"], a["layer"], a["experts"]) for a in alerts] == [
        (4, "dead_expert", 1, [2, 3]), (9, "dead_expert", 1, [2, 3])]
    assert alerts[0]["value"] == 3 and alerts[0]["threshold"] == 3
    assert "aux_loss_coeff" in alerts[0]["remedy"]
    assert len(lines) == 2 and "layer 1" in lines[0] and "experts 2, 3" in lines[0]


@dataclass(frozen=True)
class FakeAux:
    """An MoE record with the fields the monitor reads (and a per-expert dropped count)."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    router_logits: torch.Tensor
    dropped_per_expert: torch.Tensor


def fake(counts: list[float], dropped: list[float], aux: float = 1.0) -> FakeAux:
    return FakeAux(aux_loss=torch.tensor(aux), z_loss=torch.tensor(0.5), tokens_per_expert=torch.tensor(counts),
                   router_logits=torch.zeros(3, len(counts)), dropped_per_expert=torch.tensor(dropped))


def test_drop_fraction_and_collapse_alarms(tmp_path):
    cfg = MonitorConfig(collapse_fraction=0.75, collapse_window=1, drop_fraction=0.2, dead_steps=100)
    stats = RoutingStats([0], num_experts=4, top_k=2, device=torch.device("cpu"), collapse_window=1)
    tracker = AlertTracker(cfg, tmp_path / ALERTS_FILE, top_k=2, log=lambda m: None)
    stats.observe(0, fake([70, 30, 50, 50], [6, 0, 4, 0]))
    stats.observe(0, fake([10, 50, 10, 30], [0, 20, 0, 0]))
    stats.end_step(1, 2.0)
    snap = stats.snapshot()
    ls = snap.layers[0]
    assert ls.tokens == [80, 80, 60, 80]
    assert ls.drop_fraction == pytest.approx(30 / 300)
    assert ls.dropped == [6, 20, 4, 0]
    assert ls.max_share == pytest.approx(80 / 150)
    assert tracker.update(snap) == []  # 10% dropped <= 20%, 53% share <= 75%

    stats.observe(0, fake([100, 10, 80, 10], [50, 0, 10, 0]))
    stats.end_step(2, 2.0)
    new = tracker.update(stats.snapshot())
    by_kind = {a.kind: a for a in new}
    assert set(by_kind) == {"collapse", "token_drop"}
    assert by_kind["collapse"].experts == (0, 2) and by_kind["collapse"].value == pytest.approx(1.0)
    assert by_kind["token_drop"].experts == (0, 2) and by_kind["token_drop"].value == pytest.approx(60 / 200)
    assert "capacity factor" in by_kind["token_drop"].remedy
    assert "layer 0" in by_kind["collapse"].message and "expert 0 100%" in by_kind["collapse"].message


def test_collapse_share_uses_a_rolling_window_of_steps(tmp_path):
    window = 3
    cfg = MonitorConfig(collapse_fraction=0.9, collapse_window=window, dead_steps=100)
    stats = RoutingStats([2], num_experts=4, top_k=1, device=torch.device("cpu"), collapse_window=window)
    tracker = AlertTracker(cfg, tmp_path / ALERTS_FILE, top_k=1, log=lambda m: None)
    # One token-count vector per step (top-1, 10 tokens a step): a 2-step burst on expert 0 at steps 2-3 is not
    # a collapse over 3 steps; the collapse from step 5 on is, from step 7 (steps 5-7 all on expert 1).
    per_step = [[3, 3, 2, 2], [10, 0, 0, 0], [10, 0, 0, 0], [2, 3, 3, 2], [0, 10, 0, 0], [0, 10, 0, 0],
                [0, 10, 0, 0], [0, 10, 0, 0]]
    fired = {}
    for step, counts in enumerate(per_step, start=1):
        stats.observe(0, fake(counts, [0, 0, 0, 0]))
        stats.end_step(step, 2.0)
        snap = stats.snapshot()
        want = [sum(c[e] for c in per_step[max(0, step - window):step]) for e in range(4)]
        assert snap.layers[0].window_tokens == want
        assert snap.window_steps == min(step, window)
        fired[step] = [a.kind for a in tracker.update(snap)]
    assert fired == {1: [], 2: [], 3: [], 4: [], 5: [], 6: [], 7: ["collapse"], 8: []}


def test_collapse_alarm_waits_for_collapse_from_step(tmp_path):
    # Every step on expert 0 (top-1, window 3): with collapse_from_step=5 the alarm is held back at steps 3-4 and
    # fires at step 5, when the window (steps 3-5) still holds the collapse; with 0 it fires at step 1.
    def fired_at(from_step: int) -> dict[int, list[str]]:
        cfg = MonitorConfig(collapse_fraction=0.9, collapse_window=3, dead_steps=100, collapse_from_step=from_step)
        stats = RoutingStats([0], num_experts=4, top_k=1, device=torch.device("cpu"), collapse_window=3)
        tracker = AlertTracker(cfg, tmp_path / f"alerts-{from_step}.jsonl", top_k=1, log=lambda m: None)
        out = {}
        for step in range(1, 7):
            stats.observe(0, fake([10, 0, 0, 0], [0, 0, 0, 0]))
            stats.end_step(step, 2.0)
            out[step] = [a.kind for a in tracker.update(stats.snapshot())]
        return out

    assert fired_at(5) == {1: [], 2: [], 3: [], 4: [], 5: ["collapse"], 6: []}
    assert fired_at(0) == {1: ["collapse"], 2: [], 3: [], 4: [], 5: [], 6: []}
    with pytest.raises(ConfigError, match="monitor.collapse_from_step: must be >= 0"):
        build_config("tiny", overrides={"monitor": {"collapse_from_step": -1}})
    assert build_config("tiny").monitor.collapse_from_step is None  # the trainer uses train.warmup_steps


def test_records_without_a_drop_field_report_no_drop_fraction(tmp_path):
    @dataclass(frozen=True)
    class NoDrop:
        aux_loss: torch.Tensor
        tokens_per_expert: torch.Tensor
        router_logits: torch.Tensor

    stats = RoutingStats([3], num_experts=2, top_k=1, device=torch.device("cpu"))
    stats.observe(0, NoDrop(torch.tensor(1.5), torch.tensor([2.0, 1.0]), torch.zeros(3, 2)))
    stats.end_step(1)
    ls = stats.snapshot().layers[0]
    assert ls.drop_fraction is None and ls.dropped is None
    assert ls.losses == {"aux_loss": 1.5}


def test_a_monitor_enabled_at_a_resume_counts_its_interval_from_the_resumed_step(tmp_path):
    """A disabled monitor saved no statistics; enabled when the run resumes at step 10, its first interval is steps
    11..15 (it counted 15 steps when the disabled monitor's step-0 state was restored)."""
    model, layer = make_model()
    assert RoutingMonitor(model, MonitorConfig(enabled=False), tmp_path, log=lambda m: None).state_dict() is None
    monitor = RoutingMonitor(model, MonitorConfig(), tmp_path, log=lambda m: None, start_step=10)
    monitor.load_state_dict(None)
    layer.train()
    for step in range(11, 16):
        layer(torch.tensor(X))
        monitor.end_step(step, torch.tensor(2.0))
    rec = monitor.flush(15)
    assert rec["moe/interval_steps"] == 5 and sum(rec["moe/layer1/tokens"]) == 5 * 2 * len(X)


def test_real_capacity_drops_and_expert_bias_are_reported(tmp_path):
    model, layer = make_model(capacity=CapacityConfig(factor=0.5), router=RouterConfig(expert_bias=True))
    monitor = RoutingMonitor(model, MonitorConfig(), tmp_path, log=lambda m: None)
    layer.train()
    layer(torch.tensor(X))
    monitor.end_step(1, torch.tensor(2.0))
    rec = monitor.flush(1)
    # capacity = ceil(T * K / E * factor) = ceil(6 * 2 / 4 * 0.5) = 2; each expert keeps at most 2 assignments.
    counts = hand_top2(X)
    dropped = sum(max(0, c - 2) for c in counts)
    assert rec["moe/layer1/tokens"] == counts
    assert rec["moe/layer1/drop_fraction"] == pytest.approx(dropped / sum(counts))
    assert rec["moe/layer1/bias"] == layer.router.e_score_correction_bias.tolist()
    assert read_alerts(tmp_path)[0]["kind"] == "token_drop"  # 4 of 12 dropped > 10%


def test_loss_spike_uses_the_rolling_median_and_ignores_nonfinite_losses(tmp_path):
    losses = [2.0, 2.2, 1.8, 2.1, 1.9, 2.05, 9.0, 3.9]  # step 7 spikes; step 8 judged against a window with 9.0
    window, warmup = 4, 3
    stats = RoutingStats([], num_experts=0, top_k=1, device=torch.device("cpu"), spike_window=window,
                         spike_warmup=warmup)
    for step, loss in enumerate(losses, start=1):
        stats.end_step(step, torch.tensor(loss, dtype=torch.float64))
    stats.end_step(9, torch.tensor(float("nan")))
    snap = stats.snapshot()
    # Reference: the ratio of each step's loss to the lower median (torch.median's choice) of the previous
    # `window` losses, from the step that has `warmup` losses before it.
    best = None
    for i in range(warmup, len(losses)):
        prev = sorted(losses[max(0, i - window):i])
        ratio = losses[i] / prev[(len(prev) - 1) // 2]
        if best is None or ratio > best[0]:
            best = (ratio, i + 1, losses[i])
    assert (snap.spike_ratio, snap.spike_step, snap.spike_loss) == pytest.approx(best)
    assert best[1] == 7
    assert snap.nonfinite_steps == 1 and snap.nonfinite_step == 9

    lines: list[str] = []
    tracker = AlertTracker(MonitorConfig(spike_factor=2.0, spike_window=window, spike_warmup=warmup),
                           tmp_path / ALERTS_FILE, top_k=1, log=lines.append)
    kinds = [a.kind for a in tracker.update(snap)]
    assert kinds == ["loss_spike", "nonfinite_loss"]
    assert "step 7" in lines[0] and "lower train.lr" in lines[0]
    assert "step 9" in lines[1]


def test_fatal_alarm_checkpoints_then_raises(tmp_path):
    model, layer = make_model()
    monitor = RoutingMonitor(model, MonitorConfig(collapse_fraction=0.9, fatal=("collapse",)), tmp_path,
                             log=lambda m: None)
    layer.train()
    layer(torch.tensor(ONLY_01))
    monitor.end_step(1, torch.tensor(2.0))
    monitor.flush(1)
    saved = []
    with pytest.raises(TrainingAlarm) as err:
        monitor.raise_if_fatal(lambda: saved.append(1))
    assert saved == [1]
    assert isinstance(err.value, MoetrainError)
    assert "collapse" in str(err.value) and "layer 1" in str(err.value) and "checkpoint" in str(err.value)
    assert read_alerts(tmp_path)[0]["fatal"] is True

    # A non-finite loss writes no checkpoint (the weights may already be non-finite).
    monitor = RoutingMonitor(model, MonitorConfig(fatal=("nonfinite_loss",)), tmp_path / "b", log=lambda m: None)
    (tmp_path / "b").mkdir()
    monitor.end_step(1, torch.tensor(float("inf")))
    monitor.flush(1)
    saved.clear()
    with pytest.raises(TrainingAlarm, match="non-finite"):
        monitor.raise_if_fatal(lambda: saved.append(1))
    assert saved == []


def test_a_resumed_run_stops_again_at_a_fatal_alarm_that_still_holds(tmp_path):
    """A fatal collapse stops the run with a checkpoint; a resume from it (the restart loop of docs/checkpoints.md
    runs the same command again) must not train on through the collapse because its episode was saved as active.
    A non-fatal episode stays active across the resume (printed once)."""
    model, layer = make_model()
    config = MonitorConfig(collapse_fraction=0.9, dead_steps=1, fatal=("collapse",))
    first = RoutingMonitor(model, config, tmp_path, log=lambda m: None)
    layer.train()
    layer(torch.tensor(ONLY_01))
    first.end_step(1, torch.tensor(2.0))
    first.flush(1)
    with pytest.raises(TrainingAlarm, match="collapse"):
        first.raise_if_fatal(lambda: None)
    saved = first.state_dict()  # what the checkpoint of step 1 holds

    resumed = RoutingMonitor(model, config, tmp_path, log=lambda m: None, start_step=1)
    resumed.load_state_dict(saved)
    layer(torch.tensor(ONLY_01))  # still collapsed
    resumed.end_step(2, torch.tensor(2.0))
    resumed.flush(2)
    with pytest.raises(TrainingAlarm, match="collapse"):
        resumed.raise_if_fatal(lambda: None)
    assert [(a["kind"], a["step"]) for a in read_alerts(tmp_path)] == [
        ("dead_expert", 1), ("collapse", 1), ("collapse", 2)]


def test_a_full_disk_at_an_alarm_write_names_the_file(tmp_path, monkeypatch):
    """A full disk fails the buffered append with an errno but no file name: the error names alerts.jsonl."""
    import builtins
    import errno

    import moetrain.train.alerts as alerts_module
    from moetrain.runtime.oserrors import MachineError

    def full_open(file, mode="r", *args, **kwargs):
        if Path(file).name == ALERTS_FILE and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(alerts_module, "open", full_open, raising=False)
    model, layer = make_model()
    monitor = RoutingMonitor(model, MonitorConfig(collapse_fraction=0.9), tmp_path, log=lambda m: None)
    layer.train()
    layer(torch.tensor(ONLY_01))
    monitor.end_step(1, torch.tensor(2.0))
    with pytest.raises(MachineError, match=f"\\({tmp_path / ALERTS_FILE}\\): No space left on device"):
        monitor.flush(1)


def test_state_dict_resume_continues_exactly(tmp_path):
    def feed(stats: RoutingStats, steps: range) -> None:
        for step in steps:
            rows = X if step % 3 == 0 else ONLY_01
            stats.observe(0, fake(hand_top2(rows), [0, 0, 0, 0], aux=step / 10))
            stats.end_step(step, torch.tensor(2.0 + (step % 4) / 10))

    def make() -> RoutingStats:
        return RoutingStats([1], num_experts=4, top_k=2, device=torch.device("cpu"), spike_window=5, spike_warmup=2)

    straight = make()
    feed(straight, range(1, 8))
    interrupted = make()
    feed(interrupted, range(1, 5))
    resumed = make()
    resumed.load_state_dict(interrupted.state_dict())
    feed(resumed, range(5, 8))
    assert dataclasses.asdict(resumed.snapshot()) == dataclasses.asdict(straight.snapshot())


def test_folding_the_queue_in_batches_changes_nothing():
    """Statistics are the same whether the step queue is folded every 3 steps or once at the snapshot, and whether
    the layers report in the usual order (the reshape path) or not (the index_add path); 2 micro-batches a step."""
    def run(fold_every: int, order: tuple[int, ...]):
        stats = RoutingStats([1, 4], num_experts=4, top_k=2, device=torch.device("cpu"), spike_window=4,
                             spike_warmup=2, collapse_window=5)
        stats.FOLD_EVERY = fold_every
        snaps = []
        losses = [2.0, 2.1, 1.9, 2.0, 6.0, float("nan"), 2.0, 2.2, 1.8, 2.0, 9.0]
        for step, loss in enumerate(losses, start=1):
            for micro in range(2):
                for pos in order:
                    rows = ONLY_01 if (step + pos + micro) % 4 else X
                    stats.observe(pos, fake(hand_top2(rows), [step % 2, 0, micro, 0], aux=step / 7))
            stats.end_step(step, torch.tensor(loss))
            if step in (7, 11):
                snaps.append(dataclasses.asdict(stats.snapshot()))
        return snaps

    once = run(1000, (0, 1))
    assert run(3, (0, 1)) == once
    assert run(3, (1, 0)) == once
    for pos in (0, 1):  # and against a plain loop: counts of steps 1-7, idle steps at step 7
        want = [0] * 4
        last_seen = [0] * 4
        for step in range(1, 8):
            for micro in range(2):
                counts = hand_top2(ONLY_01 if (step + pos + micro) % 4 else X)
                want = [a + b for a, b in zip(want, counts)]
                last_seen = [step if c else seen for c, seen in zip(counts, last_seen)]
        assert once[0]["layers"][pos]["tokens"] == want
        assert once[0]["layers"][pos]["idle"] == [7 - seen for seen in last_seen]
    assert once[0]["spike_step"] == 5 and once[0]["nonfinite_steps"] == 1 and once[1]["spike_step"] == 11


def test_step_summaries_from_another_rank_equal_observing_the_layers():
    """A pipeline's exchange (each rank's StepSummary rows, summed over the ranks, given to end_step) gives the
    statistics of a rank that observed every layer itself: with some layers on each rank, all on the other one,
    and across a resume in the middle of a logging interval."""
    from moetrain.train.routing_stats import StepSummary, find_loss_fields

    gen = torch.Generator().manual_seed(3)
    records = [[[FakeAux(aux_loss=torch.rand((), generator=gen), z_loss=torch.rand((), generator=gen),
                         tokens_per_expert=torch.randint(0, 5, (4,), generator=gen).float(),
                         router_logits=torch.randn(6, 4, generator=gen),
                         dropped_per_expert=torch.randint(0, 2, (4,), generator=gen).float())
                 for _ in range(2)] for _ in range(3)] for _ in range(7)]  # [step][micro][layer]
    losses = [2.0, 2.1, 1.9, 2.0, 2.2, 1.8, 2.0]

    def make() -> RoutingStats:
        return RoutingStats([1, 3, 5], num_experts=4, top_k=2, device=torch.device("cpu"), spike_window=4,
                            spike_warmup=2, collapse_window=3)

    def run(local: set[int] | None, resume_at: int | None = None) -> list[dict]:
        """``local`` None: every record observed directly (``observe``); else the records of layers ``local`` in
        this rank's StepSummary and the others in another rank's, their rows summed."""
        stats, snaps = make(), []
        mine, other = (StepSummary(3, 4, find_loss_fields(FakeAux), torch.device("cpu")) for _ in range(2))
        for step in range(1, 8):
            if step == resume_at:
                state = stats.state_dict()
                stats = make()
                stats.load_state_dict(state)
            for micro in records[step - 1]:
                for pos, record in enumerate(micro):
                    if local is None:
                        stats.observe(pos, record)
                    else:
                        (mine if pos in local else other).add(pos, record)
            if local is None:
                stats.end_step(step, torch.tensor(losses[step - 1]))
            else:
                stats.end_step(step, torch.tensor(losses[step - 1]), mine, mine.take() + other.take())
            if step in (4, 7):
                snaps.append(dataclasses.asdict(stats.snapshot()))
        return snaps

    direct = run(None)
    assert direct[0]["layers"][1]["drop_fraction"] is not None and direct[0]["layers"][1]["losses"]
    for got in (run({0}), run({1}), run(set()), run({0, 1, 2}), run({2}, resume_at=3)):
        for g, want in zip(got, direct):
            for gl, wl in zip(g.pop("layers"), want["layers"]):
                assert gl["tokens"] == wl["tokens"] and gl["idle"] == wl["idle"]
                assert gl["window_tokens"] == wl["window_tokens"] and gl["dropped"] == wl["dropped"]
                for key in ("cv", "overload", "max_share", "drop_fraction", "entropy", "router_z"):
                    assert (gl[key] is None) if wl[key] is None else gl[key] == pytest.approx(wl[key], rel=1e-12)
                assert gl["losses"] == pytest.approx(wl["losses"], rel=1e-12)
            assert g == {k: v for k, v in want.items() if k != "layers"}
    stats = make()
    stats.observe(0, records[0][0][0])
    with pytest.raises(ValueError, match=r"loss fields \['aux_loss'\], the earlier records' were \['aux_loss', 'z_lo"):
        stats.end_step(1, 2.0, StepSummary(3, 4, ["aux_loss"], torch.device("cpu")))


def test_step_summary_of_a_model_without_moe_layers_takes_an_empty_row_block():
    """A dense model (model.moe_every=0) has no MoE layer: its step summary is [0, W], not an error."""
    from moetrain.train.routing_stats import StepSummary

    summary = StepSummary(0, 4, ["aux_loss"], torch.device("cpu"))
    rows = summary.take()
    assert rows.shape == (0, summary.width) and rows.dtype == torch.float64


def test_monitor_state_of_a_legacy_checkpoint_is_restored():
    """tests/data/legacy_checkpoints/single holds a monitor state of the layout before StepSummary rows: its counts,
    idle steps, collapse window and loss history carry over (its interval sums were zero: saved at a logging
    step)."""
    path = Path(__file__).parent / "data" / "legacy_checkpoints" / "single" / "checkpoints" / "step_00000003"
    saved = torch.load(path / "train_state.pt", weights_only=True)["monitor"]["stats"]
    assert "loss_names" not in saved and saved["observed"] == [0, 0]
    stats = RoutingStats([0, 1], num_experts=4, top_k=2, device=torch.device("cpu"))  # last_seen 0 until loaded
    stats.load_state_dict(saved)
    for name in ("counts", "last_seen", "window"):
        assert torch.equal(getattr(stats, name), saved[name])
    assert stats.loss_history == saved["loss_history"] and stats.steps_seen == 3 and stats.summary is None
    stats.observe(0, fake([1, 2, 3, 4], [0, 0, 0, 0]))
    stats.end_step(4, 5.7)
    snap = stats.snapshot()
    assert snap.layers[0].tokens == [1, 2, 3, 4] and snap.layers[0].losses == {"aux_loss": 1.0, "z_loss": 0.5}


def test_resumed_monitor_drops_alarms_of_steps_after_the_checkpoint(tmp_path):
    with open(tmp_path / ALERTS_FILE, "w") as f:
        for step in (5, 10, 15):
            f.write(json.dumps({"step": step, "kind": "collapse"}) + "\n")
        f.write('{"step": 20, "ki')  # cut short by a crash
    model, _ = make_model()
    RoutingMonitor(model, MonitorConfig(), tmp_path, log=lambda m: None, start_step=10)
    assert [a["step"] for a in read_alerts(tmp_path)] == [5, 10]


def test_tensorboard_histograms_and_heatmap(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model, layer = make_model(router=RouterConfig(expert_bias=True))
    monitor = RoutingMonitor(model, MonitorConfig(tb_heatmap_every=2), tmp_path, log=lambda m: None)
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    layer.train()
    for step in (1, 2, 3):
        layer(torch.tensor(X))
        monitor.end_step(step, torch.tensor(2.0))
        monitor.flush(step, writer)
    monitor.close()  # the last logging step (3) had no heatmap: close writes it
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0, "images": 0}).Reload()
    hist = acc.Histograms("moe/layer1/tokens_per_expert")
    assert [h.step for h in hist] == [1, 2, 3]
    assert list(hist[-1].histogram_value.bucket) == [float(c) for c in hand_top2(X)]
    assert [h.step for h in acc.Histograms("moe/layer1/bias")] == [1, 2, 3]
    images = acc.Images("moe/layer1/load_heatmap")
    assert [im.step for im in images] == [2, 3]
    # Experts are rows (64 // 4 = 16 px each); logging steps are columns (256 // 3 = 85 px each at step 3).
    assert (images[-1].height, images[-1].width) == (4 * 16, 3 * 85)


def test_colorize_maps_the_ends_of_the_scale():
    import numpy as np

    rgb = colorize(np.array([[0.0, 1.0, 2.0]]), vmax=1.0)
    assert rgb.shape == (1, 3, 3) and rgb.dtype == np.uint8
    assert rgb[0, 0].tolist() == [68, 1, 84] and rgb[0, 1].tolist() == [253, 231, 37] == rgb[0, 2].tolist()


def test_disabled_monitor_records_nothing(tmp_path):
    model, layer = make_model()
    monitor = RoutingMonitor(model, MonitorConfig(enabled=False), tmp_path, log=lambda m: None)
    layer.train()
    layer(torch.tensor(ONLY_01))
    monitor.end_step(1, torch.tensor(float("nan")))
    assert monitor.flush(1) == {}
    assert not (tmp_path / ALERTS_FILE).exists()


@pytest.mark.parametrize("override, message", [
    ({"collapse_fraction": 1.5}, "monitor.collapse_fraction: must be in (0, 1]"),
    ({"dead_steps": 0}, "monitor.dead_steps: must be >= 1"),
    ({"drop_fraction": -0.1}, "monitor.drop_fraction: must be in [0, 1]"),
    ({"spike_factor": 0.5}, "monitor.spike_factor: must be > 1"),
    ({"spike_window": 5, "spike_warmup": 6}, "monitor.spike_warmup: must be in [1, spike_window=5]"),
    ({"fatal": ["collapse", "bogus"]}, "monitor.fatal[1]: must be one of"),
    # a disabled monitor evaluates no alarm, so a fatal one would silently never stop the run
    ({"enabled": False, "fatal": ["collapse"]}, "monitor.fatal: ['collapse'] needs monitor.enabled=true"),
    ({"dead_step": 3}, "monitor.dead_step: unknown config key; did you mean 'monitor.dead_steps'?"),
])
def test_bad_monitor_config_names_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        build_config("tiny", overrides={"monitor": override})
    assert str(err.value).startswith(message)


def test_monitor_config_round_trips_through_the_run_config():
    cfg = build_config("tiny", overrides={"monitor": {"fatal": ["collapse"], "dead_steps": 7}})
    assert cfg.monitor.fatal == ("collapse",) and cfg.monitor.dead_steps == 7
    assert type(cfg).from_dict(json.loads(json.dumps(cfg.to_dict()))).monitor == cfg.monitor
    # Run directories written before monitoring existed load with the defaults.
    data = cfg.to_dict()
    del data["monitor"]
    assert type(cfg).from_dict(data).monitor == MonitorConfig()


def test_alerts_file_tolerates_a_partial_last_line(tmp_path):
    Path(tmp_path / ALERTS_FILE).write_text('{"step": 1, "kind": "collapse"}\n{"step": 2, "ki')
    assert read_alerts(tmp_path) == [{"step": 1, "kind": "collapse"}]
