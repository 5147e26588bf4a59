"""``moetrain plan --emit`` writes configs that ``moetrain train --config F --dry-run`` validates and lays out; every
layout the planner may recommend maps to trainer fields the trainer accepts; a shape preset too large for this
machine is refused with the per-rank figure and the smallest layout that fits."""

from __future__ import annotations

import tomllib

import pytest

from moetrain.analysis.hardware import get_hardware
from moetrain.analysis.planner import candidate_layouts, plan, trainer_fields
from moetrain.analysis.shape import ModelShape
from moetrain.cli import main
from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.model.transformer import MoETransformer
from moetrain.parallel.dry_run import check, dry_run, too_large

RECOMMENDATIONS = [("qwen3-30b-a3b", 16, "h200"), ("mixtral-8x7b", 16, "h100")]


@pytest.mark.parametrize("preset,devices,device", RECOMMENDATIONS)
def test_emitted_config_passes_the_dry_run(tmp_path, capsys, preset, devices, device):
    path = tmp_path / f"{preset}.toml"
    assert main(["plan", "--preset", preset, "--devices", str(devices), "--device", device,
                 "--emit", str(path)]) == 0
    data = tomllib.loads(path.read_text())
    assert data["preset"] == preset and "fsdp" not in data["parallel"]  # ignored by the trainer: not written
    p = data["parallel"]
    assert p["pp"] * p["ep"] * p["dp_shard"] * p["dp_replicate"] == devices
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--dry-run", "--world-size", str(devices)]) == 0
    out = capsys.readouterr().out
    assert f"= {devices} ranks" in out and "dry run: the config is valid" in out
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("device,on", [("h100", "cuda"), ("cpu", "cpu")])
def test_dry_run_of_the_emitted_config_prints_the_plans_per_rank_memory(tmp_path, capsys, device, on):
    """The emitted config names the device the plan is for, so its dry run on any machine (this one has no GPU)
    prints the plan's per-rank lines: without it a GPU plan's check here added the CPU-only MoE scratch and
    runtime (tiny, 2 x h100: 587.1 MB per rank instead of the plan's 328.9 MB)."""
    path = tmp_path / "t.toml"
    assert main(["plan", "--preset", "tiny", "--devices", "2", "--device", device, "--emit", str(path)]) == 0
    planned = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("rank")]
    assert tomllib.loads(path.read_text())["train"]["device"] == on
    assert main(["train", "--config", str(path), "--dry-run", "--world-size", "2"]) == 0
    checked = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("rank")]
    assert planned and checked == planned
    assert ("runtime 0.0 MB" in planned[0]) == (on == "cuda")


@pytest.mark.parametrize("preset,devices,device", RECOMMENDATIONS + [("olmoe-1b-7b", 64, "trn1")])
def test_every_fitting_candidate_maps_to_trainer_fields(preset, devices, device):
    cfg = build_config(preset)
    shape = ModelShape.from_config(cfg.model)
    flags = [cfg.model.is_moe_layer(i) for i in range(cfg.model.n_layers)]
    result = plan(shape, flags, devices, get_hardware(device), 4096, 1024, 2)
    fitting = [c for c in result.candidates if c.fits]
    assert fitting
    for c in fitting:
        run = build_config(preset, overrides=trainer_fields(c, 4096, "bf16"))
        layout, stages = check(run, devices)
        assert (layout.pp, layout.ep, layout.dp_shard) == (c.layout.pp, c.layout.ep, c.layout.dp)
        assert len(stages) == c.layout.pp
        # FSDP2 shards what the planner's ZeRO-1 model keeps whole: never more state per rank than it assumed.
        assert dry_run(run, devices).rank_bytes <= c.best.memory


def test_tied_embeddings_are_never_pipelined():
    shape = ModelShape.from_config(build_config("tiny").model)
    assert shape.tie_embeddings
    assert all(l.pp == 1 for l in candidate_layouts(shape, 8, 64))
    # the trainer sums the two copies' gradients
    check(build_config("tiny", overrides={"parallel": {"pp": 2}, "train": {"grad_accum": 2}}), 2)
    cfg = build_config("tiny", overrides={"parallel": {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2,
                                                       "reshard_after_forward": False}, "model": {"n_layers": 4},
                                          "train": {"grad_accum": 4}})
    with pytest.raises(ConfigError, match="model.tie_embeddings: parallel.pp_schedule='zbv'"):
        check(cfg, 2)


def test_dry_run_names_the_bad_field(capsys):
    cfg = build_config("mixtral-8x7b", overrides={"parallel": {"ep": 8, "dp_shard": 2}})
    with pytest.raises(ConfigError, match=r"world size 12 .* not a multiple of 16 = pp \* dp_replicate"):
        check(cfg, 12)
    cfg = build_config("mixtral-8x7b", overrides={"parallel": {"ep": 8}, "train": {"batch_size": 4}})
    with pytest.raises(ConfigError, match="train.batch_size: 4 sequences"):
        check(cfg, 8)


def test_too_large_preset_names_the_figure_and_the_smallest_layout():
    cfg = build_config("mixtral-8x7b")
    why = too_large(cfg, 1, "cpu", 80e9)
    assert why.startswith("preset mixtral-8x7b: needs 747.") and "80.0 GB free" in why
    assert "the smallest layout that fits is 64 cpu devices" in why and "--emit FILE.toml" in why
    assert too_large(build_config("tiny"), 1, "cpu", 80e9) is None


def test_emit_without_a_fitting_layout_fails_and_writes_nothing(tmp_path, capsys):
    # 1024 sequences do not split over 3 devices: no layout fits, so there is nothing to emit; a script running
    # `plan --emit q.toml && torchrun ... --config q.toml` must stop here, not train an older q.toml.
    path = tmp_path / "q.toml"
    assert main(["plan", "--preset", "tiny", "--devices", "3", "--device", "h100", "--emit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moetrain: error: --emit:") and "nothing fits" in err and str(path) in err, err
    assert not path.exists()


@pytest.mark.parametrize("overrides, world, field", [
    ({"model": {"tie_embeddings": False, "moe": {"losses": {"pooled_aux_loss_coeff": 0.1}}},
      "parallel": {"pp": 2}, "train": {"grad_accum": 2}}, 2, "model.moe.losses.pooled_aux_loss_coeff"),
    ({"data": {"packing": "documents"}, "parallel": {"ep": 2}}, 2, "data.packing"),
])
def test_dry_run_refuses_what_the_trainer_refuses(overrides, world, field):
    with pytest.raises(ConfigError) as e:
        check(build_config("tiny", overrides=overrides), world)
    assert str(e.value).startswith(field), str(e.value)


def test_dry_run_of_expert_parallelism_alone_counts_the_engines_shards():
    # parallel.ep=2 alone (dp_shard=1, pp=1) runs on the one FSDP2 engine: every rank holds half the experts and
    # half of each non-expert weight (sharded over the ep ranks), as with the old fsdp=on, which changes nothing.
    cfg = build_config("tiny", overrides={"parallel": {"ep": 2}})
    model = MoETransformer(cfg.model)
    run = dry_run(cfg, 2)
    assert run.rank_bytes < sum(p.numel() for p in model.parameters()) * 16
    assert "sharded over 2 ranks" in run.lines[0] and "= 2 ranks" in run.lines[0], run.lines[0]
    assert dry_run(build_config("tiny", overrides={"parallel": {"ep": 2, "fsdp": "on"}}), 2).rank_bytes == run.rank_bytes


def test_plan_prints_small_counts_and_rates_readably():
    """tiny's parameters and a CPU's rates in units that read (0.16M, 31 GFLOP/s, 12.4 GB/s), not 0.00B, 0.03 TFLOP/s
    and 0.00 TB/s."""
    from moetrain.commands.plan import _params, _si

    assert _params(160_000) == "0.16M" and _params(46_700_000_000) == "46.70B"
    assert _si(0.031e12, "FLOP/s") == "31 GFLOP/s" and _si(989.4e12, "FLOP/s") == "989 TFLOP/s"
    assert _si(12.4e9, "B/s") == "12.4 GB/s" and _si(3.35e12, "B/s") == "3.35 TB/s" and _si(450e9, "B/s") == "450 GB/s"
    assert _si(5.0, "B/s") == "5 B/s"


def test_emit_keeps_an_existing_file_unless_overwrite_and_names_the_flag(tmp_path, capsys):
    path = tmp_path / "t.toml"
    path.write_text("# mine\n")
    args = ["plan", "--preset", "tiny", "--devices", "2", "--device", "cpu", "--emit"]
    assert main([*args, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moetrain: error: --emit {path}: exists; pass --overwrite") and path.read_text() == "# mine\n"
    assert main([*args, str(path), "--overwrite"]) == 0 and tomllib.loads(path.read_text())["preset"] == "tiny"
    capsys.readouterr()
    assert main([*args, str(tmp_path)]) == 2  # a directory
    assert capsys.readouterr().err.startswith(f"moetrain: error: --emit {tmp_path}: is a directory")
    assert main([*args, str(tmp_path / "missing" / "t.toml")]) == 2  # no such parent directory
    err = capsys.readouterr().err
    assert err.startswith(f"moetrain: error: --emit {tmp_path / 'missing' / 't.toml'}: cannot write it"), err
