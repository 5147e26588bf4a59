"""The ``parallel`` config section and the mesh's checks: bad sizes fail with one clear error naming the field."""

from __future__ import annotations

import pytest
import torch

from _parallel_util import spawn
from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel import ac
from moetrain.parallel.engine import ShardedHooks
from moetrain.parallel.launch import start
from moetrain.parallel.meta_init import build_meta
from moetrain.parallel.layout import Layout, build_layout_mesh, init_layout_mesh


def test_defaults_and_round_trip():
    cfg = build_config("tiny", overrides={"parallel": {"ep": 2, "dispatcher": "all_gather", "timeout_s": 30}})
    assert cfg.parallel == ParallelConfig(ep=2, dispatcher="all_gather", timeout_s=30.0)
    assert type(cfg).from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("overrides, field, words", [
    ({"parallel": {"ep": 3}}, "parallel.ep", ["3", "num_experts=4"]),
    ({"parallel": {"ep": 0}}, "parallel.ep", [">= 1"]),
    ({"parallel": {"timeout_s": 0}}, "parallel.timeout_s", ["> 0"]),
    ({"parallel": {"dispatcher": "ring"}}, "parallel.dispatcher", ["all_to_all", "all_gather"]),
])
def test_bad_values_name_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        build_config("tiny", overrides=overrides)
    assert str(e.value).startswith(field) and all(w in str(e.value) for w in words), str(e.value)


def test_ep_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"parallel.ep: ep=2 needs 2 processes; launch with `torchrun"):
        start(build_config("tiny", overrides={"parallel": {"ep": 2}}), "cpu")
    assert not start(build_config("tiny"), "cpu").mesh.distributed
    mesh, owns = init_layout_mesh(ParallelConfig(), "cpu")
    assert not mesh.distributed and not mesh.ep_mesh.distributed and not owns


def _checks_worker(rank: int, world: int, out_dir) -> dict:
    out = {}
    try:
        init_layout_mesh(ParallelConfig(ep=4), "cpu")  # joins the existing group: the sizes are checked first
    except ConfigError as e:
        out["mesh"] = str(e)
    cfg = ParallelConfig(ep=2)
    hooks = ShardedHooks(build_layout_mesh(Layout.from_config(cfg, world), 30, torch.device("cpu")), cfg)
    try:
        hooks.local_batch(lambda: (torch.zeros(3, 4), torch.zeros(3, 4)))()
    except ConfigError as e:
        out["batch"] = str(e)
    plain = ParallelConfig(cpu_offload=True)  # 2 replicas: replicate, which has no shards to offload
    hooks = ShardedHooks(build_layout_mesh(Layout.from_config(plain, world), 30, torch.device("cpu")), plain)
    try:
        hooks.prepare_model(build_meta(build_config("tiny").model))
    except ConfigError as e:
        out["offload"] = str(e)
    return out


def test_world_size_and_batch_checks(tmp_path):
    for r in spawn(_checks_worker, 2, tmp_path):
        assert r["mesh"].startswith("parallel: world size 2") and "* 1 * 4; change parallel" in r["mesh"], r
        assert r["offload"].startswith("parallel.cpu_offload: ") and "set it to false" in r["offload"], r
        assert r["batch"].startswith("train.batch_size: 3 sequences") and "over the 2 data-parallel ranks" in r["batch"], r


def test_plain_path_refuses_cpu_offload_and_a_replica_count_for_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"^parallel.cpu_offload: .*set it to false"):
        start(build_config("tiny", overrides={"parallel": {"cpu_offload": True}}), "cpu")
    with pytest.raises(ConfigError, match=r"^parallel: world size 1 .* 1 \* 3 \* 1 \* 1"):
        start(build_config("tiny", overrides={"parallel": {"dp_replicate": 3}}), "cpu")
    # fsdp=on keeps one process off the FSDP2 engine, but not off the mesh check: dp_shard=2 needs 2 ranks
    with pytest.raises(ConfigError, match=r"^parallel: world size 1 .* \(the rest\) \* 2 \* 1"):
        start(build_config("tiny", overrides={"parallel": {"fsdp": "on", "dp_shard": 2}}), "cpu")


def test_plain_path_applies_activation_checkpointing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = build_config("tiny", overrides={"parallel": {"activation_checkpoint": "full"}})
    hooks = start(cfg, "cpu")
    model = hooks.prepare_model(hooks.build_model(cfg.model, torch.device("cpu")))
    seen = []
    model.blocks[0].attn.register_forward_hook(lambda m, i, o: seen.append(ac.in_recompute()))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 9))
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    assert seen == [False, True]  # the forward, then its recompute in backward


def _replicate_worker(rank: int, world: int, out_dir) -> str:
    try:
        start(build_config("tiny", overrides={"parallel": {"dp_replicate": 3}}), "cpu")
    except ConfigError as e:
        return str(e)
    return "started"


def test_plain_path_checks_dp_replicate_against_the_world(tmp_path):
    # dp_replicate=3 on 2 ranks: the dry run refuses it, so the run must too (every rank, before any collective).
    for r in spawn(_replicate_worker, 2, tmp_path):
        assert r.startswith("parallel: world size 2") and "1 * 3 * 1 * 1" in r, r


def test_overwrite_keeps_the_old_run_when_the_layout_is_refused(tmp_path, monkeypatch, capsys):
    from moetrain.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    assert main(["train", "--preset", "tiny", "--out", str(run), "--overwrite", "parallel.dp_replicate=3"]) == 2
    assert capsys.readouterr().err.startswith("moetrain: error: parallel: world size 1")
    assert (run / "checkpoints" / "step_00000010").is_dir() and (run / "config.json").is_file()
