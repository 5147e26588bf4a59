"""Per-component configs (issue 16): each component validates itself and its errors carry the full field path;
the execution config may change on resume, the maths may not; the older flat layout of ``model.moe`` (a run
directory's ``config.json``, a ``--config`` file, ``FIELD=VALUE`` overrides) still loads, with a one-line note per
moved field; unknown keys still get a close-match suggestion, also for a mistyped old name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import sample_text
from moetrain.cli import main
from moetrain.config import LEGACY_PATHS, Config, build_config, upgrade
from moetrain.configlib import parse_overrides, parse_size, to_dict
from moetrain.errors import ConfigError
from moetrain.execution import ExecutionConfig
from moetrain.moe.config import (
    AuxLossConfig,
    CapacityConfig,
    ExpertsConfig,
    MoEConfig,
    RouterConfig,
    SharedExpertConfig,
)
from moetrain.train.resume_config import describe, is_fixed, resume_changes

pytestmark = pytest.mark.usefixtures("one_thread")

# The MoE section as the code before the split wrote it into config.json: 27 flat fields, written out by hand (not
# derived from LEGACY_PATHS) with a non-default value in every field that has one to take.
OLD_MOE = {
    "num_experts": 8, "top_k": 2, "expert_ffn_hidden": 48, "expert_activation": "gelu", "backend": "loop",
    "recompute_experts": True, "shared_expert_ffn_hidden": 32, "shared_expert_gate": True,
    "score_func": "sigmoid", "norm_topk_prob": False, "routed_scaling_factor": 2.5, "num_groups": 4,
    "topk_groups": 2, "expert_bias": True, "expert_bias_update_rate": 0.002, "router_jitter": 0.01,
    "capacity_factor": 1.25, "eval_capacity_factor": 2.0, "min_capacity": 3, "drop_policy": "position",
    "pad_to_capacity": True,
    "aux_loss_coeff": 0.02, "pooled_aux_loss_coeff": 0.1, "seq_aux_loss_coeff": 0.003, "global_aux_loss_coeff": 0.004,
    "z_loss_coeff": 0.005, "util_loss_coeff": 0.006,
}
# The same layer in the new tree, written out by hand.
NEW_MOE = MoEConfig(
    num_experts=8, top_k=2,
    router=RouterConfig(score_func="sigmoid", norm_topk_prob=False, routed_scaling_factor=2.5, num_groups=4,
                        topk_groups=2, expert_bias=True, expert_bias_update_rate=0.002, jitter_eps=0.01),
    experts=ExpertsConfig(ffn_hidden=48, activation="gelu"),
    shared_expert=SharedExpertConfig(ffn_hidden=32, gate=True),
    capacity=CapacityConfig(factor=1.25, eval_factor=2.0, min_capacity=3, drop_policy="position",
                            pad_to_capacity=True),
    losses=AuxLossConfig(aux_loss_coeff=0.02, pooled_aux_loss_coeff=0.1, seq_aux_loss_coeff=0.003,
                         global_aux_loss_coeff=0.004, z_loss_coeff=0.005, util_loss_coeff=0.006),
)


def test_old_flat_config_json_loads_into_the_new_tree_with_one_note_per_moved_field():
    notes: list[str] = []
    old = {"preset": "tiny", "model": {"vocab_size": 512, "hidden": 64, "n_heads": 4, "n_kv_heads": 2,
                                       "bta_tiles": 2, "moe": OLD_MOE}, "train": {"batch_size": 8}}
    cfg = Config.from_dict(old, note=notes.append)
    assert cfg.model.moe == NEW_MOE
    assert cfg.model.execution == ExecutionConfig(moe_backend="loop", recompute_experts=True, bta_tiles=2)
    moved = set(OLD_MOE) - {"num_experts", "top_k"}
    assert len(notes) == len(moved) + 1  # + model.bta_tiles
    assert "note: model.moe.capacity_factor is now model.moe.capacity.factor" in notes
    assert "note: model.moe.backend is now model.execution.moe_backend" in notes
    assert "note: model.bta_tiles is now model.execution.bta_tiles" in notes
    assert "note: model.moe.router_jitter is now model.moe.router.jitter_eps" in notes
    assert old["model"]["moe"]["capacity_factor"] == 1.25  # the caller's data is not modified


def test_every_old_path_names_a_field_of_the_new_tree():
    cfg = Config()
    assert len(LEGACY_PATHS) == 26  # 25 of the 27 flat MoE fields moved (not num_experts, top_k) + bta_tiles
    for old, new in LEGACY_PATHS.items():
        node = cfg
        for part in new.split("."):
            assert hasattr(node, part), (old, new)
            node = getattr(node, part)
        parent, _, name = old.rpartition(".")
        holder = cfg
        for part in parent.split("."):
            holder = getattr(holder, part)
        assert not hasattr(holder, name), f"{old} still exists"


def test_old_override_works_with_a_note(capsys):
    overrides = upgrade(parse_overrides(["model.moe.capacity_factor=1.5", "model.moe.backend=padded"]))
    cfg = build_config("tiny", overrides=overrides)
    assert cfg.model.moe.capacity.factor == 1.5 and cfg.model.execution.moe_backend == "padded"
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: model.moe.capacity_factor is now model.moe.capacity.factor",
                   "note: model.moe.backend is now model.execution.moe_backend"]
    # build_config upgrades its sources itself (a library caller that skipped upgrade), before they are merged:
    # the old override wins over the preset's value at the new path.
    assert build_config("cpu-small", overrides={"model": {"moe": {"aux_loss_coeff": 0.5}}}).model.moe.losses \
        .aux_loss_coeff == 0.5
    assert capsys.readouterr().err == "note: model.moe.aux_loss_coeff is now model.moe.losses.aux_loss_coeff\n"


def test_old_field_in_a_config_file(tmp_path, capsys):
    path = tmp_path / "old.toml"
    path.write_text("[model.moe]\nexpert_ffn_hidden = 96\nz_loss_coeff = 0.0\n")
    assert main(["plan", "--config", str(path), "--preset", "tiny", "--devices", "2"]) == 0
    err = capsys.readouterr().err
    assert "note: model.moe.expert_ffn_hidden is now model.moe.experts.ffn_hidden" in err
    assert "note: model.moe.z_loss_coeff is now model.moe.losses.z_loss_coeff" in err


def test_old_and_new_path_with_different_values_is_refused():
    with pytest.raises(ConfigError, match=r"model\.moe\.capacity\.factor: given both as model\.moe\.capacity\."
                                          r"factor=1\.0 and under its old name model\.moe\.capacity_factor=2\.0"):
        upgrade({"model": {"moe": {"capacity_factor": 2.0, "capacity": {"factor": 1.0}}}}, note=lambda m: None)
    same = upgrade({"model": {"moe": {"capacity_factor": 1.0, "capacity": {"factor": 1.0}}}}, note=lambda m: None)
    assert same == {"model": {"moe": {"capacity": {"factor": 1.0}}}}


@pytest.mark.parametrize("override, message", [
    ("model.moe.capacity_factr=1", "model.moe.capacity_factr: unknown config key; did you mean "
                                   "'model.moe.capacity.factor'?"),
    ("model.moe.capacity.factr=1", "model.moe.capacity.factr: unknown config key; did you mean "
                                   "'model.moe.capacity.factor'?"),
    ("model.moe.num_expert=4", "model.moe.num_expert: unknown config key; did you mean 'model.moe.num_experts'?"),
    ("model.moe.router.jitter=0.1", "model.moe.router.jitter: unknown config key; did you mean "
                                    "'model.moe.router.jitter_eps'?"),
    ("model.execution.backend=loop", "model.execution.backend: unknown config key; did you mean "
                                     "'model.execution.moe_backend'?"),
])
def test_unknown_keys_get_a_close_match(override, message):
    with pytest.raises(ConfigError) as err:
        build_config("tiny", overrides=upgrade(parse_overrides([override])))
    assert str(err.value) == message


@pytest.mark.parametrize("override, message", [
    ({"moe": {"capacity": {"factor": -1}}}, "model.moe.capacity.factor: must be > 0 (or none for dropless), got -1.0"),
    ({"moe": {"capacity": {"eval_factor": 2.0}}}, "model.moe.capacity.eval_factor: needs factor"),
    ({"moe": {"router": {"jitter_eps": 1.0}}}, "model.moe.router.jitter_eps: must be in [0, 1), got 1.0"),
    ({"moe": {"router": {"expert_bias_update_rate": -0.1}}}, "model.moe.router.expert_bias_update_rate: must be >= 0"),
    ({"moe": {"router": {"routed_scaling_factor": 0}}}, "model.moe.router.routed_scaling_factor: must be > 0"),
    ({"moe": {"experts": {"ffn_hidden": 0}}}, "model.moe.experts.ffn_hidden: must be >= 1, got 0"),
    ({"moe": {"experts": {"activation": "relu"}}}, "model.moe.experts.activation: must be one of"),
    ({"moe": {"shared_expert": {"ffn_hidden": -1}}}, "model.moe.shared_expert.ffn_hidden: must be >= 0"),
    ({"moe": {"losses": {"z_loss_coeff": -0.1}}}, "model.moe.losses.z_loss_coeff: must be >= 0, got -0.1"),
    ({"execution": {"moe_backend": "cuda"}}, "model.execution.moe_backend: must be one of"),
    ({"execution": {"bta_tiles": 0}}, "model.execution.bta_tiles: must be >= 1"),
    ({"moe": {"num_experts": 6, "router": {"num_groups": 4}}}, "model.moe.router.num_groups: 4 groups do not "
                                                               "divide num_experts=6"),
])
def test_each_component_names_its_full_field_path(override, message):
    with pytest.raises(ConfigError) as err:
        build_config("tiny", overrides={"model": override})
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("override, message", [
    ("train.deterministic=null", "train.deterministic: expected true or false, got null"),
    ("train.steps=true", "train.steps: expected an integer, got true"),
    ("train.lr=null", "train.lr: expected a number, got null"),
    ("train.dtype=null", "train.dtype: must be one of ['fp32', 'bf16'], got null"),
])
def test_type_errors_write_the_value_as_a_config_does(override, message):
    with pytest.raises(ConfigError) as err:
        build_config("tiny", overrides=upgrade(parse_overrides([override])))
    assert str(err.value) == message


@pytest.mark.parametrize("raw, value", [
    ("[nonfinite_loss, collapse]", ("nonfinite_loss", "collapse")),  # what a shell leaves of ['a', 'b']
    ("['nonfinite_loss']", ("nonfinite_loss",)),
    ('["collapse"]', ("collapse",)),  # JSON
    ("[]", ()),
])
def test_list_overrides_with_or_without_quotes(raw, value):
    config = build_config("tiny", overrides=upgrade(parse_overrides([f"monitor.fatal={raw}"])))
    assert config.monitor.fatal == value


def test_direct_construction_validates_too():
    with pytest.raises(ConfigError, match=r"^factor: must be > 0"):
        CapacityConfig(factor=0.0)
    with pytest.raises(ConfigError, match=r"^router\.num_groups: 3 groups do not divide num_experts=8"):
        MoEConfig(router=RouterConfig(num_groups=3))
    with pytest.raises(ConfigError, match=r"^gate: needs a shared expert"):
        SharedExpertConfig(gate=True)


@pytest.mark.parametrize("override, message", [
    ("model.moe.shared_expert.ffn_hidden=-1",
     "model.moe.shared_expert.ffn_hidden: must be >= 0 (0 = no shared expert), got -1"),
    ("parallel.dp_replicate=-2", "parallel.dp_replicate: must be >= 0 (0 = the rest of the world), got -2"),
    ("model.execution.bta_tiles=0", "model.execution.bta_tiles: must be >= 1 (1 = no batch tiling), got 0"),
    ("data.seq_len=1", "data.seq_len: must be >= 2, got 1"),
    ("model.moe.top_k=0", "model.moe.top_k: must be >= 1, got 0"),
    ("train.weight_decay=-0.5", "train.weight_decay: must be >= 0, got -0.5"),
])
def test_lower_bounds_say_the_bound_its_meaning_and_the_value(override, message):
    with pytest.raises(ConfigError) as e:
        build_config("tiny", overrides=parse_overrides([override]))
    assert str(e.value) == message


def test_execution_may_change_on_resume_the_maths_may_not():
    saved = build_config("tiny")
    new = build_config("tiny", overrides={"model": {"execution": {"moe_backend": "loop", "recompute_experts": True,
                                                                  "bta_tiles": 2}}})
    assert [c[0] for c in resume_changes(saved, new)] == ["model.execution.bta_tiles", "model.execution.moe_backend",
                                                          "model.execution.recompute_experts"]
    for path in ("model.moe.router.jitter_eps", "model.moe.capacity.factor", "model.moe.losses.aux_loss_coeff",
                 "model.moe.experts.ffn_hidden", "model.moe.shared_expert.gate"):
        assert is_fixed(path), path
    changed = build_config("tiny", overrides={"model": {"moe": {"capacity": {"factor": 2.0}}}})
    with pytest.raises(ConfigError, match=r"model\.moe\.capacity\.factor: cannot change when resuming"):
        resume_changes(saved, changed)


def test_resume_messages_write_values_as_a_config_does():
    """null, not None; true / false, not True / False; strings quoted as every ConfigError quotes them."""
    saved = build_config("tiny")
    assert saved.train.expert_weight_decay is None
    changed = build_config("tiny", overrides={"train": {"expert_weight_decay": 1.0}})
    with pytest.raises(ConfigError) as err:
        resume_changes(saved, changed)
    assert str(err.value).startswith("train.expert_weight_decay: cannot change when resuming (the run was trained "
                                     "with null, got 1.0); start a new run")
    with pytest.raises(ConfigError, match=r"^train\.expert_weight_decay: .* trained with 1\.0, got null\)"):
        resume_changes(changed, saved)
    allowed = build_config("tiny", overrides={"monitor": {"collapse_from_step": 50, "tb_heatmap": False},
                                              "train": {"dtype": "bf16"}})
    assert describe(resume_changes(saved, allowed)) == ("monitor.collapse_from_step null -> 50, "
                                                        "monitor.tb_heatmap true -> false, train.dtype 'fp32' -> 'bf16'")


def test_round_trip_through_plain_data():
    cfg = build_config("tiny", overrides={"model": {"moe": to_dict(NEW_MOE), "execution": {"moe_backend": "loop"}},
                                          "train": {"batch_size": 8}})
    assert Config.from_dict(to_dict(cfg), note=pytest.fail) == cfg  # the new layout gives no notes


def _old_layout(run: Path) -> None:
    """Rewrite the run's config.json the way the code before the split wrote it (flat model.moe, model.bta_tiles)."""
    data = json.loads((run / "config.json").read_text())
    moe, execution = data["model"]["moe"], data["model"].pop("execution")
    router, capacity = moe.pop("router"), moe.pop("capacity")
    experts, shared = moe.pop("experts"), moe.pop("shared_expert")
    flat = {**moe, **moe.pop("losses"), **router, "expert_ffn_hidden": experts["ffn_hidden"],
            "expert_activation": experts["activation"], "backend": execution["moe_backend"],
            "recompute_experts": execution["recompute_experts"], "shared_expert_ffn_hidden": shared["ffn_hidden"],
            "shared_expert_gate": shared["gate"], "router_jitter": router["jitter_eps"],
            "capacity_factor": capacity["factor"], "eval_capacity_factor": capacity["eval_factor"],
            "min_capacity": capacity["min_capacity"], "drop_policy": capacity["drop_policy"],
            "pad_to_capacity": capacity["pad_to_capacity"]}
    data["model"]["moe"] = {name: flat[name] for name in OLD_MOE}  # only the fields the old code had
    data["model"]["bta_tiles"] = execution["bta_tiles"]
    (run / "config.json").write_text(json.dumps(data, indent=2))


def test_a_run_written_with_the_old_layout_resumes(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(sample_text(50_000))
    run = tmp_path / "run"
    common = ["--no-progress", f"data.cache_dir={tmp_path / 'cache'}", "train.eval_batches=1",
              "monitor.tb_heatmap=false"]
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--steps", "4",
                 "--stop-at-step", "2", *common]) == 0
    _old_layout(run)
    capsys.readouterr()
    # An old override of an execution field (allowed on resume) on top of the old config.json.
    assert main(["train", "--out", str(run), "--resume", *common, "model.moe.backend=loop"]) == 0
    out, err = capsys.readouterr()
    assert "note: model.moe.backend is now model.execution.moe_backend" in err
    assert "note: model.moe.capacity_factor is now model.moe.capacity.factor" in err
    assert "resuming with a changed config: model.execution.moe_backend 'fused' -> 'loop'" in out
    assert "done: 4 steps" in out
    resumed = json.loads((run / "config.json").read_text())  # rewritten with the change, in the new layout
    assert resumed["model"]["execution"]["moe_backend"] == "loop" and "backend" not in resumed["model"]["moe"]


@pytest.mark.parametrize("text", ["5GB", "500MB", "40KB", "2GiB", "3MiB", "7KiB", "1000000"])
def test_parse_size_reads_units_as_transformers_does(text):
    hub = pytest.importorskip("transformers.utils.hub")
    expected = int(text) if text.isdigit() else hub.convert_file_size_to_int(text)
    assert parse_size(text, "--max-shard-size") == expected


def test_parse_size_bare_suffix_is_binary_and_errors_name_flag_and_value():
    assert parse_size("64M", "--f") == 64 * 2**20 and parse_size("1.5g", "--f") == 3 * 2**29
    assert parse_size(" 2 tb ", "--f") == 2 * 10**12 and parse_size("1TiB", "--f") == 2**40
    for bad, why in [("5XB", "not a byte count"), ("-1GB", "not a byte count"), ("", "not a byte count"),
                     ("0", "must be at least 1 byte"), ("0.1", "must be at least 1 byte")]:
        with pytest.raises(ConfigError, match=f"^--flag {bad!r}: {why}"):
            parse_size(bad, "--flag")
