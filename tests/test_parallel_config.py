"""The ``parallel`` config section and the mesh's checks: bad sizes fail with one clear error naming the field."""

from __future__ import annotations

import pytest
import torch

from _parallel_util import spawn
from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.launch import ParallelHooks
from moetrain.parallel.mesh import build_mesh, init_distributed


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
        init_distributed(ParallelConfig(ep=2))
    assert not init_distributed(ParallelConfig()).distributed


def _checks_worker(rank: int, world: int, out_dir) -> dict:
    out = {}
    try:
        build_mesh(4, timeout_s=30)
    except ConfigError as e:
        out["mesh"] = str(e)
    hooks = ParallelHooks(build_mesh(2, timeout_s=30))
    try:
        hooks.local_batch(lambda: (torch.zeros(3, 4), torch.zeros(3, 4)))()
    except ConfigError as e:
        out["batch"] = str(e)
    return out


def test_world_size_and_batch_checks(tmp_path):
    for r in spawn(_checks_worker, 2, tmp_path):
        assert r["mesh"].startswith("parallel.ep: world size 2") and "not divisible by ep=4" in r["mesh"], r
        assert r["batch"].startswith("train.batch_size: 3 sequences") and "over 2 ranks" in r["batch"], r
