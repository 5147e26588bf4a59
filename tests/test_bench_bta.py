"""``moetrain bench bta`` runs end to end on a tiny shape and reports consistent figures (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from moetrain.cli import main


def test_bench_bta_tiny(tmp_path, capsys):
    out = tmp_path / "bta.json"
    args = ["bench", "bta", "--experts", "8", "--top-k", "2", "--hidden", "32", "--expert-ffn", "16", "--heads",
            "2", "--layers", "1", "--vocab", "64", "--seq", "16", "--batch", "8", "--tiles", "4", "--steps", "1",
            "--warmup", "0", "--attention", "fused", "--no-recompute-experts", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "(c) BTA, 4 tiles of 2" in text
    report = json.loads(out.read_text())
    from test_perf_bench import assert_cpu_recorded

    assert_cpu_recorded(report["machine"], next(s for s in text.splitlines() if s.startswith("bench bta:")))
    a, b, c = (report["modes"][k] for k in "abc")
    # Tokens per expert GEMM: (a) and (c) route all 8 x 16 tokens at once, (b) a quarter of them per micro-batch.
    assert a["tokens_per_expert_gemm"] == c["tokens_per_expert_gemm"] == 8 * 16 * 2 / 8
    assert b["tokens_per_expert_gemm"] == a["tokens_per_expert_gemm"] / 4
    # Saved bytes: one micro-batch < BTA (MoE on the whole batch) < whole batch (attention of the whole batch).
    assert b["saved_bytes"] < c["saved_bytes"] < a["saved_bytes"]
    for mode in (a, b, c):
        assert mode["saved_bytes_predicted"] == pytest.approx(mode["saved_bytes"], rel=0.10)
        assert mode["tokens_per_s"] > 0
    assert report["ratios"]["c_over_b_saved_bytes"] == pytest.approx(c["saved_bytes"] / b["saved_bytes"])


def test_bench_bta_rejects_bad_tiles(capsys):
    assert main(["bench", "bta", "--batch", "6", "--tiles", "4"]) == 2
    assert "--tiles" in capsys.readouterr().err


def test_bench_bta_attention_bound_tiny(tmp_path, capsys):
    # The default regime (math attention, recomputed experts) on a tiny shape: BTA keeps fewer bytes than the
    # whole batch, the cost model predicts every mode within 10%, and the figures are consistent.
    out = tmp_path / "bta.json"
    args = ["bench", "bta", "--experts", "8", "--hidden", "32", "--expert-ffn", "64", "--heads", "4", "--layers",
            "2", "--vocab", "64", "--seq", "64", "--batch", "4", "--tiles", "4", "--steps", "1", "--warmup", "0",
            "--json", str(out)]
    assert main(args) == 0
    assert "math attention" in capsys.readouterr().out
    report = json.loads(out.read_text())
    a, b, c = (report["modes"][k] for k in "abc")
    assert c["saved_bytes"] < a["saved_bytes"] and b["saved_bytes"] < a["saved_bytes"]
    for mode in (a, b, c):
        assert mode["saved_bytes_predicted"] == pytest.approx(mode["saved_bytes"], rel=0.10)
    assert report["args"]["recompute_experts"] is True
