"""``train.router_lr_scale`` / ``train.expert_lr_scale``: the AdamW groups they create, one update against plain
``torch.optim.AdamW`` at the scaled learning rate, the schedule on them, and exact resume (issue 19's ablation of a
learning rate of their own for the router and the experts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _crash_util import losses_by_step
from conftest import sample_text
from moetrain.cli import main
from moetrain.config import build_config
from moetrain.errors import ConfigError
from moetrain.model.transformer import MoETransformer
from moetrain.train.checkpoint import CheckpointStore
from moetrain.train.resume_config import is_fixed
from moetrain.train.schedule import build_scheduler, lr_factor, retarget_schedule
from moetrain.train.trainer import build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")

SCALES = {"router_lr_scale": 0.25, "expert_lr_scale": 2.0}


def _model_and_optimizer(**train):
    config = build_config("tiny", overrides={"train": train,
                                             "model": {"moe": {"shared_expert": {"ffn_hidden": 16}}}})
    torch.manual_seed(0)
    model = MoETransformer(config.model)
    return config, model, build_optimizer(model, config)


def test_defaults_keep_the_two_groups():
    _, model, opt = _model_and_optimizer()
    assert [g["lr_scale"] for g in opt.param_groups] == [1.0, 1.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_each_parameter_is_in_the_group_of_its_scale():
    config, model, opt = _model_and_optimizer(**SCALES)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert len(group_of) == len(list(model.parameters()))  # each parameter exactly once
    for name, p in model.named_parameters():
        g = group_of[id(p)]
        want = 0.25 if name.endswith("ffn.router.weight") else 2.0 if ".ffn.experts." in name else 1.0
        assert g["lr_scale"] == want and g["lr"] == pytest.approx(config.train.lr * want), name
        assert g["weight_decay"] == (config.train.weight_decay if p.dim() >= 2 else 0.0), name
    shared = [n for n, _ in model.named_parameters() if "shared_expert" in n]
    assert shared and all(group_of[id(dict(model.named_parameters())[n])]["lr_scale"] == 1.0 for n in shared)


def _step_against_plain_adamw(config, model, opt, sched, specs):
    """One step of ``opt`` (random gradients) against a plain ``torch.optim.AdamW`` per parameter of ``specs``
    ((name, lr scale, weight decay), ...) at the schedule's first rate: the updated tensors must agree."""
    t = config.train
    step_lr = t.lr * lr_factor(0, t)
    params = dict(model.named_parameters())
    refs = {}
    for name, scale, wd in specs:
        ref = params[name].detach().clone().requires_grad_(True)
        refs[name] = (ref, torch.optim.AdamW([ref], lr=step_lr * scale, betas=(t.beta1, t.beta2), eps=t.eps,
                                             weight_decay=wd))
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for name, (ref, ref_opt) in refs.items():
        ref.grad = params[name].grad.clone()
        ref_opt.step()
    opt.step()
    sched.step()
    for name, (ref, _) in refs.items():
        assert torch.allclose(params[name].detach(), ref.detach(), rtol=0, atol=1e-7), name


def test_one_step_equals_plain_adamw_at_the_scaled_rate():
    config, model, opt = _model_and_optimizer(**SCALES)
    sched = build_scheduler(opt, config.train)
    t = config.train
    _step_against_plain_adamw(config, model, opt, sched, [
        ("blocks.0.ffn.router.weight", 0.25, t.weight_decay),
        ("blocks.0.ffn.experts.gate_up_proj", 2.0, t.weight_decay),
        ("blocks.0.attn.q_proj.weight", 1.0, t.weight_decay)])
    factor = lr_factor(1, config.train)  # the schedule moves every group by the same factor
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([t.lr * g["lr_scale"] * factor
                                                                  for g in opt.param_groups])
    before = [g["lr"] for g in opt.param_groups]
    retarget_schedule(opt, sched, config.train)  # an unchanged config recomputes the same rates
    assert [g["lr"] for g in opt.param_groups] == before


def test_scale_must_be_positive():
    with pytest.raises(ConfigError, match=r"^train.expert_lr_scale: must be > 0 and finite, got 0"):
        build_config("tiny", overrides={"train": {"expert_lr_scale": 0}})


def _args(corpus: Path, cache: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(out), "--no-progress", "--steps", "8",
            f"data.cache_dir={cache}", "data.seq_len=32", "train.batch_size=4", "train.log_every=1",
            "train.ckpt_every=4", "train.eval_every=0", "train.warmup_steps=2", "monitor.tb_heatmap=false",
            "monitor.tb_histograms=false", "train.router_lr_scale=0.25", "train.expert_lr_scale=2", *extra]


def test_resume_is_exact_and_refuses_a_changed_scale(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(sample_text(30_000))
    cache, ref, run = tmp_path / "cache", tmp_path / "ref", tmp_path / "run"
    assert main(_args(corpus, cache, ref)) == 0
    assert main([*_args(corpus, cache, run), "--stop-at-step", "4"]) == 0
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "train.expert_lr_scale=3"]) == 2
    assert "train.expert_lr_scale" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert losses_by_step(run) == losses_by_step(ref) and len(losses_by_step(ref)) == 8
    a = CheckpointStore(run / "checkpoints").latest_valid()[0].model_tensors()
    b = CheckpointStore(ref / "checkpoints").latest_valid()[0].model_tensors()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    plain = tmp_path / "plain"  # the scales change the training: a run without them differs
    assert main([*_args(corpus, cache, plain, "train.router_lr_scale=1", "train.expert_lr_scale=1")]) == 0
    assert losses_by_step(plain)[8] != losses_by_step(ref)[8]


def test_expert_weight_decay_groups_and_one_step_against_plain_adamw():
    """``train.expert_weight_decay``: the routed experts' tensors (not the shared expert's) decay at their own rate,
    every other matrix at ``train.weight_decay``; one update equals plain AdamW at that decay."""
    config, model, opt = _model_and_optimizer(expert_weight_decay=0.7, expert_lr_scale=2.0)
    t = config.train
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert len(group_of) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        want = 0.0 if p.dim() < 2 else 0.7 if ".ffn.experts." in name else t.weight_decay
        assert group_of[id(p)]["weight_decay"] == want, name
    _step_against_plain_adamw(config, model, opt, build_scheduler(opt, t), [
        ("blocks.0.ffn.experts.down_proj", 2.0, 0.7),
        ("blocks.0.ffn.shared_expert.down_proj.weight", 1.0, t.weight_decay)])


def test_expert_weight_decay_unset_is_the_default_and_fixed_on_resume():
    _, model, opt = _model_and_optimizer(expert_weight_decay=None)
    assert len(opt.param_groups) == 2
    assert is_fixed("train.expert_weight_decay")
    for bad in (-0.5, float("inf")):
        with pytest.raises(ConfigError, match=rf"^train.expert_weight_decay: must be >= 0 and finite, got {bad}"):
            build_config("tiny", overrides={"train": {"expert_weight_decay": bad}})


def _group_lines(text: str) -> list[tuple[str, int, int, float, float]]:
    """The dry run's optimizer group lines as (role, tensors, parameters, lr, weight decay)."""
    import re

    found = re.findall(r"^  (.+): (\d+) tensors, ([\d,]+) parameters, lr ([\d.e-]+)(?: \([^)]*\))?, "
                       r"weight decay ([\d.e-]+)$", text, re.M)
    return [(role, int(n), int(p.replace(",", "")), float(lr), float(wd)) for role, n, p, lr, wd in found]


def test_dry_run_prints_the_optimizer_groups_the_trainer_builds(capsys):
    """``moetrain train --dry-run`` with the default preset (cpu-small): one line per AdamW group, counted from the
    meta model, equal to the groups ``build_optimizer`` gives a real model of the same config."""
    assert main(["train", "--dry-run"]) == 0
    out = capsys.readouterr().out
    config = build_config("cpu-small")
    t = config.train
    assert f"optimizer: AdamW, 4 parameter groups (whole model; train.lr={t.lr:g})" in out
    printed = _group_lines(out)
    assert [g[0] for g in printed] == ["matrices", "norms and biases", "routers", "routed experts"]
    groups = {g[0]: g for g in printed}
    assert groups["routers"][3] == pytest.approx(0.1 * t.lr) and groups["routers"][4] == t.weight_decay == 0.1
    assert groups["routed experts"][3] == pytest.approx(t.lr) and groups["routed experts"][4] == 1.0
    assert groups["matrices"][4] == 0.1 and groups["norms and biases"][4] == 0.0
    assert "lr 0.0003 (0.1 x train.lr), weight decay 0.1" in out and "weight decay 1.0\n" in out
    torch.manual_seed(0)
    model = MoETransformer(config.model)
    opt = build_optimizer(model, config)
    assert [(len(g["params"]), sum(p.numel() for p in g["params"]), g["lr"], g["weight_decay"])
            for g in opt.param_groups] == [(n, p, pytest.approx(lr), wd) for _, n, p, lr, wd in printed]
    assert sum(g[2] for g in printed) == sum(p.numel() for p in model.parameters())


def test_dry_run_names_shared_groups_by_what_they_hold():
    """With one scale for routers and experts they share a group; without any, they are among the matrices."""
    from moetrain.parallel.dry_run import dry_run

    both = "\n".join(dry_run(build_config("tiny", overrides={"train": {"router_lr_scale": 0.5,
                                                                         "expert_lr_scale": 0.5}}), 1).lines)
    assert [g[0] for g in _group_lines(both)] == ["matrices", "norms and biases", "routers + routed experts"]
    plain = "\n".join(dry_run(build_config("tiny"), 1).lines)
    assert [g[0] for g in _group_lines(plain)] == ["matrices (with the routers and routed experts)", "norms and biases"]
