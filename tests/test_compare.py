"""`moetrain compare`: variants trained side by side on the same tokens; the table, the JSON, the plots; the
trainer's wall-clock budget (train.time_budget_s) that `--seconds` sets; one-line errors for bad specs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moetrain.cli import main
from moetrain.commands.compare import Run, is_override, parse_variant, plan_waves
from moetrain.commands.compare_leads import lead_rows, leads_markdown, loss_at_seconds

from conftest import sample_text

DENSE = "dense:model.moe_every=0,model.ffn_hidden=128"  # the tiny preset's dense twin: the same active size


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(sample_text(200_000))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _compare(out: Path, corpus: Path, cache: Path, *extra: str) -> int:
    return main(["compare", *extra, "--out", str(out), "--preset", "tiny", "--data", str(corpus),
                 f"data.cache_dir={cache}", "train.eval_every=3", "train.log_every=3", "train.eval_batches=1"])


def test_two_variants_train_on_the_same_tokens_and_are_tabulated(tmp_path, corpus, cache, capsys):
    out = tmp_path / "cmp"
    assert _compare(out, corpus, cache, DENSE, "moe:", "--steps", "6") == 0
    printed = capsys.readouterr().out
    for name in ("compare.json", "compare.md", "loss_vs_tokens.png", "loss_vs_seconds.png", "compare-command.json"):
        assert (out / name).is_file(), name
    assert (out / "loss_vs_tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads((out / "compare.json").read_text())
    runs = {r["variant"]: r for r in report["runs"]}
    assert list(runs) == ["dense", "moe"] and all(r["seed"] == 0 and r["exit_code"] == 0 for r in runs.values())
    dense, moe = runs["dense"], runs["moe"]
    assert dense["params_total"] == dense["params_active"]  # no experts
    assert moe["params_active"] < moe["params_total"]  # 2 of 4 experts per token
    for r in (dense, moe):
        assert [e["step"] for e in r["evals"]] == [0, 3, 6] and r["steps"] == 6 and r["stopped_by"] == "steps"
        assert [e["tokens"] for e in r["evals"]] == [0, 3 * 8 * 64, 6 * 8 * 64]  # batch 8 x seq 64 per step
        assert r["evals"][0]["seconds"] == 0 and 0 < r["evals"][1]["seconds"] < r["evals"][2]["seconds"]
        assert r["final_val_loss"] == r["evals"][-1]["val_loss"] < r["evals"][0]["val_loss"]
        assert r["median_tokens_per_s"] > 0
        config = json.loads((out / "configs" / f"{r['variant']}-s0.json").read_text())
        assert config["train"]["seed"] == 0 and config["train"]["threads"] == 1
        assert config["data"]["path"] == str(corpus)
        assert json.loads((Path(r["run_dir"]) / "config.json").read_text()) == config  # what the child trained

    # The same tokens: each run logged the fingerprint of the first batch it trained on; they are equal, and equal
    # to the first batch of seed 0 rebuilt here from the shared token cache (and seed 1's differs: not a constant).
    assert dense["first_batch_sha256"] == moe["first_batch_sha256"] is not None
    assert report["same_first_batch"] == {"0": True}
    from moetrain.config import Config
    from moetrain.data.dataset import prepare_data
    from moetrain.data.loader import build_pipeline
    from moetrain.train.progress import batch_fingerprint

    cfg = Config.from_dict(json.loads((out / "configs" / "moe-s0.json").read_text()))
    data = prepare_data(cfg.data, cfg.model.vocab_size, tokenizer_path=Path(moe["run_dir"]) / "tokenizer.json",
                        log=lambda line: None)

    def first_batch(seed: int) -> str:
        pipeline = build_pipeline(data, cfg.data.seq_len, "windows", cfg.train.batch_size, 0, 1, seed)
        try:
            return batch_fingerprint(pipeline.train.next_batch())
        finally:
            pipeline.train.close()

    assert first_batch(0) == moe["first_batch_sha256"] != first_batch(1)

    md = (out / "compare.md").read_text()
    table = [line for line in md.split("Leads over")[0].splitlines() if line.startswith("|")]
    assert table[0] == ("| variant | seed | params (active) | val @ 3 | val @ 6 | steps | train s | final val loss | "
                        "median tokens/s |")
    assert [row.split(" | ")[0:2] for row in table[2:]] == [["| dense", "0"], ["| moe", "0"]]
    assert f"| {moe['final_val_loss']:.3f} |" in table[3]
    assert "CPU " in md and "avx512_bf16" in md and "load average" in md and "torch " in md
    assert "every variant trained on the same first batch" in md

    # The MoE's leads over the dense twin (the first variant), recomputed here with numpy's interpolation.
    [lead] = report["leads"]
    assert (lead["variant"], lead["seed"], lead["baseline"], lead["same_wave"]) == ("moe", 0, "dense", True)
    assert lead["tokens"] == 6 * 8 * 64
    assert lead["lead_per_token"] == pytest.approx(dense["final_val_loss"] - moe["final_val_loss"], abs=1e-12)
    t_star = min(dense["evals"][-1]["seconds"], moe["evals"][-1]["seconds"])
    interp = {name: float(np.interp(t_star, [e["seconds"] for e in r["evals"]], [e["val_loss"] for e in r["evals"]]))
              for name, r in runs.items()}
    assert lead["seconds"] == t_star
    assert lead["lead_same_seconds"] == pytest.approx(interp["dense"] - interp["moe"], abs=1e-12)
    assert lead["speed_ratio"] == pytest.approx(moe["median_tokens_per_s"] / dense["median_tokens_per_s"])
    assert "Leads over `dense`" in md and f"| moe | 0 | {6 * 8 * 64} | {lead['lead_per_token']:+.3f} |" in md
    assert table[-1] in printed and printed.rstrip().endswith(md.rstrip().splitlines()[-1])  # tables last

    # An existing DIR is never replaced silently.
    capsys.readouterr()
    assert _compare(out, corpus, cache, "moe:", "--steps", "6") == 2
    assert capsys.readouterr().err.startswith(f"moetrain: error: --out {out}: exists and is not empty")


def test_seconds_budget_stops_the_run_after_a_final_evaluation(tmp_path, corpus, cache, capsys):
    out = tmp_path / "cmp"
    # train.steps stays the upper bound (and the schedule); 10 ms of training ends it far earlier
    assert _compare(out, corpus, cache, "moe:", "--seconds", "0.01", "train.steps=1000") == 0
    report = json.loads((out / "compare.json").read_text())
    (r,) = report["runs"]
    assert r["stopped_by"] == "time budget" and 1 <= r["steps"] < 1000
    last = r["evals"][-1]
    assert last["step"] == r["steps"] and last["seconds"] >= 0.01 and r["final_val_loss"] == last["val_loss"]
    run_dir = Path(r["run_dir"])
    assert (run_dir / "checkpoints" / f"step_{r['steps']:08d}").is_dir()  # checkpointed where it stopped
    log = (out / "logs" / "moe-s0.log").read_text()
    assert f"stopped after step {r['steps']} of 1000: train.time_budget_s=0.01 s ran out" in log
    assert json.loads((out / "configs" / "moe-s0.json").read_text())["train"]["time_budget_s"] == 0.01
    assert "| moe | 0 |" in (out / "compare.md").read_text()


def test_a_failed_run_has_no_final_loss_and_no_lead(tmp_path, corpus, cache, capsys):
    """A run that diverges at its first steps (every update non-finite, the trainer stops it) keeps its step-0
    evaluation in compare.json, but no final loss, no training seconds and no lead; and a variant that evaluates
    more often is named as one whose seconds hold other work."""
    out = tmp_path / "cmp"
    bad = "bad:train.lr=1e12,train.max_nonfinite_skips=1,train.eval_every=2"
    assert _compare(out, corpus, cache, "moe:", bad, "--steps", "6") == 1
    printed = capsys.readouterr().out
    report = json.loads((out / "compare.json").read_text())
    runs = {r["variant"]: r for r in report["runs"]}
    assert runs["moe"]["exit_code"] == 0 and runs["bad"]["exit_code"] != 0
    assert [e["step"] for e in runs["bad"]["evals"]] == [0] and runs["bad"]["final_val_loss"] is None
    [lead] = report["leads"]
    assert lead["variant"] == "bad" and lead["lead_per_token"] is None and lead["lead_same_seconds"] is None
    assert lead["note"] == f"bad failed (exit {runs['bad']['exit_code']}): no lead"
    md = (out / "compare.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| bad | 0 | "))
    assert row.endswith(f"| {runs['bad']['steps']} (exit {runs['bad']['exit_code']}) | - | - | - |")
    [note] = report["notes"]
    assert note.startswith("Note: the variants differ in train.eval_every (moe 3, bad 2)") and note in md
    assert note in printed


@pytest.mark.parametrize("spec, message", [
    ("dense:model.moe_evry=0", "variant 'dense': model.moe_evry: unknown config key; did you mean 'model.moe_every'?"),
    ("dense:model.moe_every=-1", "variant 'dense': model.moe_every: must be >= 0, got -1"),
    ("dense:moe_every", "variant 'dense': override 'moe_every': expected FIELD=VALUE"),
    ("no such:x=1", "variant 'no such:x=1': the name 'no such' must start with"),
    ("nosuch.toml", "variant 'nosuch.toml': no such config file, and not NAME:FIELD=VALUE"),
])
def test_a_bad_spec_is_one_line_and_exit_2(tmp_path, capsys, spec, message):
    out = tmp_path / "cmp"
    assert main(["compare", spec, "moe:", "--out", str(out), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"moetrain: error: {message}"), err
    assert not out.exists()  # checked before anything is written


def test_other_one_line_errors(tmp_path, capsys):
    out = str(tmp_path / "cmp")
    cases = [
        (["compare", "moe:", "moe:train.lr=1e-3", "--out", out],
         "variant 'moe:train.lr=1e-3': its name 'moe' is taken"),
        (["compare", "moe:", "--out", out, "--seeds", "0,x"], "--seeds: expected comma-separated integers"),
        (["compare", "--out", out, "train.lr=1e-3"], "compare: give at least one VARIANT"),
        (["compare", "moe:", "--out", out, "--preset", "tiny", "train.nope=1"], "variant 'moe': train.nope: unknown"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"moetrain: error: {message}"), err
    with pytest.raises(SystemExit) as e:  # argparse's own errors: one line too
        main(["compare", "moe:", "--out", out, "--steps", "3", "--seconds", "3"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == ("moetrain compare: error: argument --seconds: not allowed with argument "
                                               "--steps (see moetrain compare --help)")


def test_spec_parsing(tmp_path):
    v = parse_variant("wide:model.ffn_hidden=256,model.moe.experts.ffn_hidden=128,train.lr=1e-3")
    assert v.name == "wide" and v.overrides == {"model": {"ffn_hidden": 256, "moe": {"experts": {"ffn_hidden": 128}}},
                                                "train": {"lr": 1e-3}}
    assert parse_variant("moe:").overrides == {}
    assert parse_variant("x:a.b=[1,2],c=3").overrides == {"a": {"b": [1, 2]}, "c": 3}  # commas inside a value
    config = tmp_path / "my run.toml"
    config.write_text("[model]\nmoe_every = 0\n")
    v = parse_variant(str(config))
    assert v.name == "my-run" and v.file_data == {"model": {"moe_every": 0}}
    assert is_override("train.lr=1e-3") and not is_override("moe:") and not is_override("dense:train.lr=1")
    # a spec longer than a file name may be (255 bytes) is still a spec, not an OSError from the file check
    long = "moe:" + ",".join(f"model.moe.router.routed_scaling_factor={i}.0" for i in range(12))
    assert len(long) > 255 and parse_variant(long).overrides == {"model": {"moe": {"router": {
        "routed_scaling_factor": 11.0}}}}
    assert not is_override(long) and is_override("train.lr=" + "1" * 300)


def _evals(points):
    return [{"step": i, "tokens": i * 100, "seconds": t, "val_loss": v} for i, (t, v) in enumerate(points)]


def _summary(variant, seed, points, rate, wave=0, exit_code=0):
    return {"variant": variant, "seed": seed, "evals": _evals(points), "median_tokens_per_s": rate, "wave": wave,
            "exit_code": exit_code}


def test_leads_by_hand():
    """Leads over the first variant against values derived by hand: per token at the most common tokens, at the
    same seconds at the earlier run's end with the other run interpolated, marked when the runs did not share a
    wave, and none for a failed run."""
    base = _summary("dense", 0, [(0.0, 9.0), (100.0, 5.0), (200.0, 4.8)], 1000.0)
    slow = _summary("moe", 0, [(0.0, 9.0), (110.0, 4.9), (220.0, 4.6)], 900.0)
    fast = _summary("fast", 0, [(0.0, 9.0), (50.0, 5.5), (150.0, 4.9)], 1500.0, wave=1)
    short = _summary("short", 0, [(0.0, 9.0)], None)  # stopped before its first evaluation after training
    dead = _summary("dead", 0, [(0.0, 9.0), (100.0, 4.0)], 1200.0, exit_code=-9)  # killed after one evaluation
    rows = {r["variant"]: r for r in lead_rows([base, slow, fast, short, dead])}
    assert list(rows) == ["moe", "fast", "short", "dead"]
    # moe: at 200 tokens 4.8 - 4.6; at t* = 200 s, moe = 4.9 + (4.6 - 4.9) * 90 / 110.
    assert rows["moe"]["tokens"] == 200 and rows["moe"]["lead_per_token"] == pytest.approx(0.2)
    assert rows["moe"]["seconds"] == 200.0
    assert rows["moe"]["lead_same_seconds"] == pytest.approx(4.8 - (4.9 - 0.3 * 90 / 110))
    assert rows["moe"]["speed_ratio"] == pytest.approx(0.9) and rows["moe"]["same_wave"]
    assert rows["moe"]["note"] is None
    # fast ends first: t* = 150 s, dense = 5.0 + (4.8 - 5.0) * 50 / 100 = 4.9; fast = 4.9; ran in another wave.
    assert rows["fast"]["lead_per_token"] == pytest.approx(4.8 - 4.9)
    assert rows["fast"]["seconds"] == 150.0 and rows["fast"]["lead_same_seconds"] == pytest.approx(0.0)
    assert not rows["fast"]["same_wave"] and "another wave" in rows["fast"]["note"]
    for name in ("short", "dead"):
        assert rows[name]["lead_per_token"] is None and rows[name]["lead_same_seconds"] is None
        assert rows[name]["speed_ratio"] is None
    assert rows["dead"]["note"] == "dead failed (exit -9): no lead"
    md = leads_markdown(list(rows.values()))
    assert "| moe | 0 | 200 | +0.200 | 200.0 | +0.145 | 0.90 |  |" in md
    assert "| fast | 0 | 200 | -0.100 | 150.0 | +0.000 | 1.50 | another wave: seconds and tokens/s not comparable |" in md
    assert "| short | 0 | - | - | - | - | - |  |" in md
    assert "| dead | 0 | - | - | - | - | - | dead failed (exit -9): no lead |" in md
    assert loss_at_seconds(base["evals"], 250.0) is None  # no extrapolation
    assert lead_rows([base]) == [] and leads_markdown([]) == ""
    # A failed baseline: no lead for any variant of its seed; short runs keep their seconds' digits.
    rows = lead_rows([_summary("dense", 1, [(0.0, 9.0), (0.02, 8.0)], 1.0, exit_code=1),
                      _summary("moe", 1, [(0.0, 9.0), (0.027, 8.5)], 1.0)])
    assert rows[0]["lead_per_token"] is None and rows[0]["note"] == "dense failed (exit 1): no lead"
    rows = lead_rows([_summary("dense", 1, [(0.0, 9.0), (0.02, 8.0)], 1.0),
                      _summary("moe", 1, [(0.0, 9.0), (0.027, 8.5)], 1.0)])
    assert "| moe | 1 | 100 | -0.500 | 0.020 |" in leads_markdown(rows)


def _runs(variants, seeds):
    return [Run(v, seed, None, f"{v}-s{seed}") for seed in seeds for v in variants]


@pytest.mark.parametrize("variants, seeds, parallel, expected", [
    # V = 2: parallel 2 is one seed a wave; 4 is two seeds; 3 leaves a slot free rather than split seed 1.
    ("ab", [0, 1], 2, [["a-s0", "b-s0"], ["a-s1", "b-s1"]]),
    ("ab", [0, 1, 2], 4, [["a-s0", "b-s0", "a-s1", "b-s1"], ["a-s2", "b-s2"]]),
    ("ab", [0, 1], 3, [["a-s0", "b-s0"], ["a-s1", "b-s1"]]),
    # V = 3 with parallel 2 (the helper's case): never a wave mixing seed 0's x with seed 1's a.
    ("abx", [0, 1], 2, [["a-s0", "b-s0"], ["x-s0"], ["a-s1", "b-s1"], ["x-s1"]]),
    ("abx", [0], 1, [["a-s0"], ["b-s0"], ["x-s0"]]),
    ("abx", [0, 1], 5, [["a-s0", "b-s0", "x-s0"], ["a-s1", "b-s1", "x-s1"]]),
])
def test_waves_keep_a_seeds_variants_together(variants, seeds, parallel, expected):
    runs = _runs(list(variants), seeds)
    waves = plan_waves(runs, parallel)
    assert [[r.name for r in w] for w in waves] == expected
    assert all(len(w) <= parallel for w in waves)
    assert [r.wave for r in runs] == [n for r in runs for n, w in enumerate(waves) if r in w]
    for seed in seeds:  # the first variant shares its wave with as many of its seed's variants as fit
        seed_runs = [r for r in runs if r.seed == seed]
        together = sum(r.wave == seed_runs[0].wave for r in seed_runs)
        assert together == min(parallel, len(variants))
