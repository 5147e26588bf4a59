"""``moetrain doctor``: the breakdown is printed, and its MFU agrees (within 10%) with moetrain.analysis' FLOPs of a
step / the step time this test measures itself / the calibrated peak; monitoring is measured, communication is 0%
only for a one-process run."""

from __future__ import annotations

import pytest

from conftest import sample_text
from moetrain.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    (root / "corpus.txt").write_bytes(sample_text(50_000))
    assert main(["train", "--preset", "tiny", "--data", str(root / "corpus.txt"), "--out", str(root / "run"),
                 "--no-progress", "--steps", "4", "train.log_every=2", f"data.cache_dir={root / 'cache'}",
                 "train.eval_batches=1", "train.threads=1"]) == 0
    return root / "run"


def test_doctor_prints_the_breakdown(run, capsys):
    capsys.readouterr()
    assert main(["doctor", str(run), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for words in ("machine: ", "usable cores", "load average", "bf16: native flags", "peak (calibrated 1024^3 GEMM, best of 4 "
                  "rounds", "fp32", "step ", "forward", "backward", "optimizer", "monitoring",
                  "communication 0% (the run was one process)", "achieved", "MFU", "the run's own log: median",
                  "data loading", "the run's MFU", "x the window's (its wall time also holds", "of this window's MFU"):
        assert words in out, words
    assert any(line.startswith("- ") for line in out.splitlines())  # at least one finding / recommendation


def test_the_run_vs_window_explanation_closes():
    """The two measured ratios it prints multiply to the run's MFU over the window's (the same FLOPs per token)."""
    import re

    from moetrain.commands.doctor import compare_with_run

    d = {"tokens_per_step": 1000, "times": {"step": 0.1}, "peak_flops": {"fp32": 1e11}, "compute_dtype": "fp32",
         "mfu": 0.2, "run": {"tokens_per_s": 6000.0, "peak": 1.2e11, "mfu": 0.2 * 0.6 / 1.2, "data_share": 0.05}}
    text = compare_with_run(d)
    assert text.startswith("the run's MFU 10.0% vs this window's 20.0%: its tokens/s were 0.60x the window's")
    assert "data loading 5.0%, evaluations" in text
    assert text.endswith("0.60 x 100.0 / 120.0 = 0.50 of this window's MFU")
    assert float(re.search(r"= ([\d.]+) of", text).group(1)) == pytest.approx(d["run"]["mfu"] / d["mfu"], abs=0.005)
    assert "above 100%" not in text
    # a run logged before its trainer re-measured the peak (seen: 157.7% on a run calibrated under load 6)
    d["run"].update(mfu=1.5, peak=0.4e11, tokens_per_s=7500.0)
    assert "a logged MFU above 100% means the run's peak was calibrated while the machine was busier" in \
        compare_with_run(d)
    d["run"].pop("mfu")
    assert compare_with_run(d) is None


def test_doctor_mfu_agrees_with_analysis_flops_over_a_step_time_measured_here(run, monkeypatch):
    """Doctor's MFU vs moetrain.analysis' FLOPs of a step / the median time of the same steps measured by this
    test's own clock / doctor's calibrated peak: within 10%. The test wraps the trainer's step function that doctor's
    window runs (moetrain.train.step.train_step) and times every call itself, so both sides see the same steps under
    the same load (on this shared machine a step moves by +-20% from one second to the next); the first call of a
    window (doctor's warm-up) is left out. A doctor whose timing or FLOP count were off fails."""
    import json
    import statistics
    import time

    import moetrain.train.step as step_module
    from moetrain.analysis.flops import step_flops as part_flops
    from moetrain.analysis.flops import total_flops
    from moetrain.analysis.shape import ModelShape
    from moetrain.commands.doctor import diagnose
    from moetrain.config import Config

    config = Config.from_dict(json.loads((run / "config.json").read_text()))
    assert config.train.tokens_per_batch == 0 and config.data.packing == "windows"  # [batch_size, seq_len] batches
    calls: list[float] = []
    real_step = step_module.train_step

    def timed_step(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_step(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - t0)

    monkeypatch.setattr(step_module, "train_step", timed_step)
    t = config.train
    flops = total_flops(part_flops(ModelShape.from_config(config.model), t.batch_size * t.grad_accum,
                                   config.data.seq_len))  # forward + backward, no recomputation
    ratios = []
    for _ in range(3):
        calls.clear()
        d = diagnose(config, str(run), 3)
        assert len(calls) == 4  # one warm-up + 3 profiled steps, all through the trainer's step function
        peak = d["peak_flops"][d["compute_dtype"]]
        ratios.append(d["mfu"] / (flops / statistics.median(calls[1:]) / peak))
        assert 0 < d["mfu"] < 1
    assert statistics.median(ratios) == pytest.approx(1.0, rel=0.10), ratios
    parts = sum(d["times"][k] for k in ("forward", "backward", "optimizer", "monitoring"))
    assert parts == pytest.approx(d["times"]["step"], rel=1e-9)  # the shares add up to the step
    assert d["times"]["forward"] > 0 and d["times"]["optimizer"] > 0 and d["times"]["monitoring"] > 0


def test_monitoring_is_measured_from_the_run_and_the_window(run):
    """The trainer logs monitor_s (its own timer around the routing monitor and the metrics writes); doctor turns
    it into a share of the run's wall time, and measures the monitor's cost in its window too."""
    import json

    from moetrain.commands.doctor import _run_metrics

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train_loss" in r]
    assert logged and all(0 < r["monitor_s"] < r["elapsed_s"] for r in logged)
    m = _run_metrics(str(run), 1.0)
    assert 0 < m["monitor_share"] < 1 and 0 <= m["data_share"] < 1
    assert m["monitor_share"] == pytest.approx(sum(r["monitor_s"] for r in logged) / logged[-1]["elapsed_s"])


def test_communication_is_0_only_for_one_process(run, tmp_path):
    import shutil

    from moetrain.commands.doctor import _communication, run_processes

    assert run_processes(str(run)) == 1 and _communication(1) == "communication 0% (the run was one process)"
    sharded = tmp_path / "sharded"
    step = sharded / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    for rank in range(4):
        (step / f"__{rank}_0.distcp").write_bytes(b"")
    assert run_processes(str(sharded)) == 4
    assert _communication(4).startswith("communication not measured (the run used 4 processes")
    assert run_processes(None) is None and "0%" not in _communication(None)
    shutil.rmtree(sharded)


def test_doctor_recommends_fewer_threads_on_a_loaded_machine():
    from moetrain.commands.doctor import findings

    d = {"load": 2.0, "threads": 2, "usable_cores": 2, "dtype": "fp32", "bf16_fast": False,
         "peak_flops": {"fp32": 1e11, "bf16": 1e9}, "times": {"step": 1.0, "optimizer": 0.1}, "run": None,
         "mfu": 0.5}
    assert findings(d) == ["threads: 2 threads on 2 usable cores with a load of 2.0 oversubscribe the CPU; set "
                           "train.threads=1"]
    d.update(busy=0.2)  # the cores busy now win over the load average (which counts this process's own work)
    assert not any(f.startswith("threads:") for f in findings(d))
    d.update(busy=1.6)
    assert findings(d) == ["threads: 2 threads on 2 usable cores with other processes busy on 1.6 oversubscribe the "
                           "CPU; set train.threads=1"]
    d.update(load=0.0, busy=None, threads=1, dtype="bf16")
    assert findings(d)[0].startswith("bf16: this CPU has no fast bf16 GEMMs")


def test_the_window_has_the_runs_micro_batch_shape():
    """Fixed shape: batch_size x seq_len; a token budget: the full-length rows that fit it (FLOPs follow)."""
    from moetrain.commands.doctor import batch_shape, step_flops
    from moetrain.config import build_config

    fixed = build_config("tiny", None, {"train": {"grad_accum": 2}})
    budget = build_config("tiny", None, {"data": {"packing": "documents"},
                                         "train": {"tokens_per_batch": 200, "grad_accum": 2}})
    assert batch_shape(fixed) == (8, 64) and batch_shape(budget) == (3, 64)
    assert step_flops(budget) / step_flops(fixed) == pytest.approx(3 / 8)


def test_mfu_never_exceeds_100_percent_and_load_is_said(run, monkeypatch, capsys):
    """A peak held down by load (here: GEMM rates faked far below any real step, and varying 3x between rounds)
    gives no MFU above 100%: doctor says the MFU could not be measured and that the figures are unreliable, and
    its bf16 advice gives the measured range, not one number."""
    import itertools
    import re

    import moetrain.runtime.cpu as cpu

    rates = itertools.cycle([2e6, 1e7, 6e6, 9e6])  # fp32, bf16, fp32, bf16, ... FLOP/s: far below a tiny step
    monkeypatch.setattr(cpu, "gemm_peak", lambda *a, **k: next(rates))
    capsys.readouterr()
    assert main(["doctor", str(run), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "MFU not measured: the steps ran faster than every fp32 peak round" in out, out
    assert "note: the figures below are unreliable: " in out and "the fp32 peak varied by 67% between rounds" in out
    assert "bf16: bf16 GEMMs ran 1.5x-5.0x the fp32 rate here, a range too wide to trust" in out
    for mfu in re.findall(r"MFU (\d+\.\d)% of", out):
        assert float(mfu) <= 100.0


def test_peak_measurement_is_the_best_round_and_flags_disagreement(monkeypatch):
    import itertools

    import moetrain.runtime.cpu as cpu
    from moetrain.analysis.hardware import measure_peaks

    monkeypatch.setattr(cpu, "gemm_peak", lambda *a, **k: next(steady))
    steady = itertools.cycle([100e9, 200e9, 95e9, 190e9, 98e9, 210e9])
    m = measure_peaks(rounds=3)
    assert m.rates == {"fp32": [100e9, 95e9, 98e9], "bf16": [200e9, 190e9, 210e9]}
    assert m.best("fp32") == 100e9 and m.best("bf16") == 210e9
    assert m.ratios("bf16", "fp32") == pytest.approx([2.0, 2.0, 210 / 98])
    if m.busy is None or m.busy < 0.5:  # an idle moment of this shared machine: rounds within 10% are trusted
        assert m.unreliable() is None
    steady = itertools.cycle([100e9, 200e9, 30e9, 60e9])
    m = measure_peaks(rounds=2)
    assert "the fp32 peak varied by 70% between rounds" in m.unreliable()
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        measure_peaks(rounds=0)
