"""``moetrain doctor``: the breakdown is printed, and its MFU is moetrain.analysis' FLOPs of a step / the measured
step time / the calibrated peak (within 10%)."""

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
    for words in ("machine: ", "usable cores, load average", "bf16: native flags", "peak (calibrated 1024^3 GEMM): "
                  "fp32", "step ", "forward", "backward", "optimizer", "communication 0% (one process)",
                  "achieved", "MFU", "the run's own log: median", "data loading"):
        assert words in out, words
    assert any(line.startswith("- ") for line in out.splitlines())  # at least one finding / recommendation


def test_doctor_mfu_is_analysis_flops_over_the_measured_step_time(run):
    import json

    from moetrain.analysis.flops import step_flops as part_flops
    from moetrain.analysis.flops import total_flops
    from moetrain.analysis.shape import ModelShape
    from moetrain.commands.doctor import diagnose
    from moetrain.config import Config

    config = Config.from_dict(json.loads((run / "config.json").read_text()))
    d = diagnose(config, str(run), steps=2)
    t = config.train
    flops = total_flops(part_flops(ModelShape.from_config(config.model), t.batch_size * t.grad_accum,
                                   config.data.seq_len))  # forward + backward, no recomputation
    expected = flops / d["times"]["step"] / d["peak_flops"][d["compute_dtype"]]
    assert d["mfu"] == pytest.approx(expected, rel=0.10)
    assert d["times"]["step"] == pytest.approx(sum(d["times"][k] for k in ("forward", "backward", "optimizer")),
                                               rel=0.5)
    assert 0 < d["mfu"] < 1


def test_doctor_recommends_fewer_threads_on_a_loaded_machine():
    from moetrain.commands.doctor import findings

    d = {"load": 2.0, "threads": 2, "usable_cores": 2, "dtype": "fp32", "bf16_fast": False,
         "peak_flops": {"fp32": 1e11, "bf16": 1e9}, "times": {"step": 1.0, "optimizer": 0.1}, "run": None,
         "mfu": 0.5}
    assert findings(d) == ["threads: 2 threads on 2 usable cores with a load of 2.0 oversubscribe the CPU; set "
                           "train.threads=1"]
    d.update(load=0.0, threads=1, dtype="bf16")
    assert findings(d)[0].startswith("bf16: this CPU has no fast bf16 GEMMs")
