"""Cost-model pieces with hand-derived values, hardware presets and files, and the planner's choices on small
synthetic cases (by expert count, by memory fit, BTA when memory-bound)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moetrain.analysis.comm import all_reduce_bytes, all_to_all_bytes
from moetrain.analysis.hardware import PRESETS, Hardware, calibrate_cpu, get_hardware, load_hardware
from moetrain.analysis.intensity import expert_intensity, tokens_per_expert
from moetrain.analysis.params import count_params, state_memory
from moetrain.analysis.planner import plan, preferred_family
from moetrain.analysis.shape import ModelShape
from moetrain.cli import main
from moetrain.errors import ConfigError
from moetrain.model.config import ModelConfig
from moetrain.moe.config import ExpertsConfig, MoEConfig


def _shape(experts=8, layers=4, hidden=256, ffn=512, heads=4, head_dim=None, top_k=2) -> ModelShape:
    cfg = ModelConfig(vocab_size=1000, hidden=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                      head_dim=head_dim, ffn_hidden=ffn, max_seq_len=4096, tie_embeddings=False,
                      moe=MoEConfig(num_experts=experts, top_k=top_k, experts=ExpertsConfig(ffn_hidden=ffn)))
    return ModelShape.from_config(cfg)


def _hw(mem_gb=1000.0, **kw) -> Hardware:
    base = dict(name="synthetic", peak_flops=100e12, mem_bytes=mem_gb * 1e9, mem_bw=2e12, intra_bw=200e9,
                inter_bw=25e9, devices_per_node=8, efficiency=0.5)
    base.update(kw)
    return Hardware(**base)


def test_hand_derived_pieces():
    s = _shape(experts=8, hidden=4, ffn=2, heads=2, top_k=2)
    # 10 tokens x top-2 over 8 experts: 2.5 rows per expert; with EP=4 each expert serves 4 ranks' tokens.
    assert tokens_per_expert(s, 10) == 2.5
    assert tokens_per_expert(s, 10, ep=4) == 10.0
    # One SwiGLU expert, 3 rows, D=4, F=2, bf16: 2*3*4*2*3 = 144 FLOPs; weights 3*4*2*2 = 48 B;
    # activations 3 * (2*4 + 3*2) * 2 = 84 B.
    i = expert_intensity(s, 3, act_bytes=2, weight_bytes=2)
    assert (i.flops, i.weight_bytes, i.act_bytes) == (144, 48, 84)
    assert i.intensity == pytest.approx(144 / 132)
    # All-to-all: 10 tokens x 2 rows x D=4 x 2 B x 4 exchanges x 3/4 leave the rank, 1 layer.
    assert all_to_all_bytes(s, 10, ep=4, moe_layers=1) == 10 * 2 * 4 * 2 * 4 * 3 / 4
    assert all_to_all_bytes(s, 10, ep=1, moe_layers=1) == 0
    assert all_reduce_bytes(1000, 4, 4) == 2 * 3 / 4 * 1000 * 4


def test_state_memory_shards_experts_and_optimizer():
    s = _shape(experts=8, layers=4)
    c = count_params(s)
    full = state_memory(c, 4)
    assert full.total == c.total * 16  # fp32 weights + grads + two AdamW moments
    ep = state_memory(c, 4, ep=8)
    assert ep.weights == pytest.approx((c.dense + c.experts / 8) * 4)
    z = state_memory(c, 4, ep=8, dense_replicas=8, expert_replicas=1, zero1=True)
    assert z.optimizer == pytest.approx((c.dense / 8 + c.experts / 8) * 8)


def test_preferred_family_by_expert_count():
    assert [preferred_family(e) for e in (1, 8, 9, 32, 33, 128)] == ["DP", "DP", "EPxDP", "EPxDP", "EPxPP", "EPxPP"]


@pytest.mark.parametrize("experts,family", [(8, "DP"), (16, "EPxDP"), (64, "EPxPP")])
def test_plan_follows_expert_count_when_memory_is_ample(experts, family):
    s = _shape(experts=experts)
    p = plan(s, [True] * 4, devices=16, hw=_hw(), seq=256, global_batch=64)
    assert p.recommended is not None and p.recommended.layout.family == family
    assert p.recommended.layout.devices == 16
    assert f"{experts} experts" in p.reason


def test_plan_refines_by_memory_fit():
    """8 experts prefer DP, but replicated experts do not fit: the planner moves to EP x DP, and says why."""
    s = _shape(experts=8, hidden=512, ffn=2048, layers=4)
    c = count_params(s)
    # Memory between the EP8 state (experts / 8) and the DP state (all experts).
    ep_state = state_memory(c, 4, ep=8, dense_replicas=16, expert_replicas=2, zero1=True).total
    dp_state = state_memory(c, 4, dense_replicas=16, expert_replicas=16, zero1=True).total
    hw = _hw(mem_gb=(ep_state + dp_state) / 2 / 1e9 / 0.9)
    p = plan(s, [True] * 4, devices=16, hw=hw, seq=128, global_batch=64)
    assert p.recommended.layout.family == "EPxDP"
    assert "no DP layout fits" in p.reason
    assert not any(c.fits for c in p.candidates if c.layout.family == "DP")


def test_plan_reports_when_nothing_fits():
    p = plan(_shape(experts=8), [True] * 4, devices=2, hw=_hw(mem_gb=0.001), seq=128, global_batch=8)
    assert p.recommended is None and "nothing fits" in p.reason


def test_plan_recommends_bta_when_attention_memory_limits_a_starved_moe():
    """Wide attention (H * Hd = 32 D) with 64 thin top-1 experts on a device whose expert GEMMs are memory-bound:
    with memory for only a fifth of the whole batch's activations, tiling the attention lets a larger micro-batch
    fit (more tokens per expert GEMM) than untiled. With ample memory the whole batch fits untiled and G = 1."""
    s = _shape(experts=64, hidden=128, ffn=512, heads=32, head_dim=128, layers=2, top_k=1)
    hw = dict(peak_flops=1000e12, mem_bw=1e12)  # ridge 1000 FLOP/B: the expert GEMMs starve
    ample = plan(s, [True, True], devices=1, hw=_hw(mem_gb=1000, **hw), seq=128, global_batch=64)
    best = ample.recommended.best
    assert (best.workload.bta_tiles, best.workload.micro_batch) == (1, 64)
    assert "already fits untiled" in ample.bta_reason
    mem = (best.state_bytes + 0.2 * best.activation_bytes) / 0.9
    tight = plan(s, [True, True], devices=1, hw=_hw(mem_gb=mem / 1e9, **hw), seq=128, global_batch=64)
    chosen, untiled = tight.recommended.best, tight.recommended.untiled
    assert chosen.workload.bta_tiles > 1, tight.bta_reason
    assert chosen.workload.micro_batch > untiled.workload.micro_batch
    assert chosen.tokens_per_expert > untiled.tokens_per_expert and chosen.step_s < untiled.step_s
    assert "BTA G=" in tight.bta_reason and "tokens/expert" in tight.bta_reason


def test_hardware_presets_have_sources():
    for hw in PRESETS.values():
        for name in ("peak_flops", "mem_bytes", "mem_bw", "intra_bw", "inter_bw", "efficiency"):
            assert hw.sources.get(name), f"{hw.name}.{name} has no source"
    assert PRESETS["h100"].ridge == pytest.approx(989.4e12 / 3.35e12)


def test_cpu_calibration_measures_something():
    hw = calibrate_cpu(size=128, repeats=3)
    # Bounds any CPU of this century passes even while descheduled (a load of 11 on 2 cores read 0.07 GFLOP/s at
    # one 128^3 product): the test is that something was measured, not how fast.
    assert hw.peak_flops > 1e7 and hw.mem_bw > 1e7 and hw.mem_bytes > 1e9
    assert "measured" in hw.sources["peak_flops"]


def test_user_hardware_files(tmp_path):
    fields = {k: v for k, v in dataclasses.asdict(PRESETS["h100"]).items() if k not in ("name", "sources")}
    j = tmp_path / "mygpu.json"
    j.write_text(json.dumps(fields))
    assert load_hardware(j).name == "mygpu" and load_hardware(j).peak_flops == fields["peak_flops"]
    t = tmp_path / "chip.toml"
    t.write_text("\n".join(f"{k} = {v}" for k, v in fields.items()))
    assert get_hardware(str(t)).mem_bw == fields["mem_bw"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**fields, "tflops": 1}))
    with pytest.raises(ConfigError, match="unknown hardware fields"):
        load_hardware(bad)
    with pytest.raises(ConfigError, match="--device a100"):
        get_hardware("a100")


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_plan_command_on_presets(preset, capsys):
    assert main(["plan", "--preset", preset, "--devices", "64", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "why: " in out and "BTA G=" in out
    family = "EPxDP" if preset == "mixtral-8x7b" else "EPxPP"  # 8 experts: DP does not fit; 128: EP x PP
    line = next(l for l in out.splitlines() if l.startswith("*"))
    assert family in line


def test_plan_command_errors(capsys):
    assert main(["plan", "--preset", "tiny", "--devices", "0"]) == 2
    assert "--devices" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--devices", "2", "--device", "nope"]) == 2


def test_recompute_experts_trades_the_pre_activation_for_one_input_projection():
    """Hand-derived: recomputed (fused, dropless) experts keep N x 2F fewer elements per MoE layer (N = T * K rows,
    SwiGLU pre-activation) and cost the input projections' forward once more (2 N D 2F FLOPs per layer)."""
    from moetrain.analysis.step import Layout, Workload, estimate

    s = _shape(experts=8, layers=4, hidden=256, ffn=512, top_k=2)
    assert s.fused_experts and not s.recompute_experts
    hw = _hw(mem_bw=1e18)  # compute-bound expert GEMMs: time = FLOPs / (peak * efficiency)
    work = dict(seq=128, global_batch=8, micro_batch=4, act_bytes=2)
    base = estimate(s, [True] * 4, Layout(), Workload(**work), hw)
    rexp = estimate(s, [True] * 4, Layout(), Workload(**work, recompute_experts=True), hw)
    rows = 4 * 128 * 2
    assert base.activation_bytes - rexp.activation_bytes == 4 * rows * 2 * 512 * 2
    extra_flops = 2 * 4 * (2 * rows * 256 * 2 * 512)  # 2 micro-batches x 4 layers x input projections
    assert rexp.compute_s - base.compute_s == pytest.approx(extra_flops / (100e12 * 0.5), rel=1e-9)


def test_plan_uses_recomputed_experts_when_moe_activations_fill_memory():
    """Wide experts, narrow attention: the MoE layer's activations dominate, so BTA cannot help; with memory for
    the state plus about half of the whole batch's activations, recomputing the experts lets the whole batch fit as
    one micro-batch."""
    s = _shape(experts=8, hidden=128, ffn=2048, heads=2, layers=2, top_k=2)
    hw = dict(peak_flops=100e12, mem_bw=1e12)
    ample = plan(s, [True, True], devices=1, hw=_hw(mem_gb=1000, **hw), seq=128, global_batch=16)
    whole = ample.recommended.best
    assert (whole.workload.micro_batch, whole.workload.recompute_experts, whole.workload.checkpoint) == (16, False, False)
    mem = (whole.state_bytes + 0.55 * whole.activation_bytes) / 0.9
    tight = plan(s, [True, True], devices=1, hw=_hw(mem_gb=mem / 1e9, **hw), seq=128, global_batch=16)
    best = tight.recommended.best
    assert best.workload.recompute_experts and not best.workload.checkpoint, best.workload
    assert best.workload.micro_batch == 16 and best.fits
    assert best.step_s < whole.step_s * 1.5
    from moetrain.analysis.step import Layout, estimate

    ckpt = estimate(s, [True, True], Layout(), dataclasses.replace(best.workload, recompute_experts=False,
                                                                   checkpoint=True), _hw(mem_gb=mem / 1e9, **hw))
    # Full checkpointing is no better: its recomputation holds a whole block's MoE activations again, and it
    # reruns whole blocks.
    assert not ckpt.fits or ckpt.step_s > best.step_s
    assert not estimate(s, [True, True], Layout(), dataclasses.replace(best.workload, recompute_experts=False),
                        _hw(mem_gb=mem / 1e9, **hw)).fits


def test_autocast_weight_copies_count_only_the_local_experts_under_ep():
    from moetrain.analysis.activations import weight_copy_bytes

    s = dataclasses.replace(_shape(experts=8, hidden=64, ffn=32), shared_ffn=16)
    assert weight_copy_bytes(s, "moe", 2) == (8 * 3 * 64 * 32 + 3 * 64 * 16) * 2
    assert weight_copy_bytes(s, "moe", 2, ep=4) == (2 * 3 * 64 * 32 + 3 * 64 * 16) * 2
    assert weight_copy_bytes(s, "moe", 4, ep=4) == 0.0  # fp32: the parameters themselves are saved
