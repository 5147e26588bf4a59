"""Hugging Face interop, per family: exact round trip ours -> HF -> ours, logits and greedy generation against
transformers' own implementation in both directions, declared expert layouts, and one-line errors.

Reference: transformers' modeling code on CPU in fp32 (tiny random configs, no downloads)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moetrain.errors import CheckpointError, ConfigError
from moetrain.interop.hf import from_hf, to_hf
from moetrain.interop.layouts import (
    FUSED,
    LAYOUTS,
    MEGATRON,
    PER_EXPERT,
    W123,
    detect_layout,
)
from moetrain.model.config import ModelConfig
from moetrain.model.generate import generate
from moetrain.model.transformer import MoETransformer
from moetrain.moe.config import ExpertsConfig, MoEConfig, RouterConfig, SharedExpertConfig

V = 101
BASE = {"vocab_size": V, "hidden": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 40,
        "max_seq_len": 64, "init_std": 0.1}


def _moe(**kw) -> MoEConfig:
    return MoEConfig(**{"num_experts": 4, "top_k": 2, "experts": ExpertsConfig(ffn_hidden=24), **kw})


# Each family with the features it maps, and a layer plan with dense blocks where the family has them.
OURS = {
    "mixtral": lambda: ModelConfig(**BASE, moe=_moe(router=RouterConfig(norm_topk_prob=True))),
    # Mixtral has no routed_scaling_factor: the export folds it into down_proj, the import divides it back out.
    "mixtral-scaled": lambda: ModelConfig(**BASE, moe=_moe(router=RouterConfig(routed_scaling_factor=2.5))),
    "qwen3_moe": lambda: ModelConfig(**{**BASE, "n_layers": 3}, qk_norm="head", head_dim=16, tie_embeddings=False,
                                     first_k_dense=1, moe=_moe(router=RouterConfig(norm_topk_prob=False))),
    "olmoe": lambda: ModelConfig(**BASE, qk_norm="full", tie_embeddings=False,
                                 moe=_moe(router=RouterConfig(norm_topk_prob=False))),
    "qwen2_moe": lambda: ModelConfig(**{**BASE, "n_layers": 4}, attention_bias=True, moe_every=2,
                                     moe=_moe(router=RouterConfig(norm_topk_prob=False),
                                              shared_expert=SharedExpertConfig(ffn_hidden=20, gate=True))),
    "dots1": lambda: ModelConfig(**{**BASE, "n_layers": 3}, qk_norm="head", first_k_dense=1, tie_embeddings=False,
                                 moe=_moe(num_experts=8, top_k=2,
                                          router=RouterConfig(score_func="sigmoid", norm_topk_prob=True,
                                                              routed_scaling_factor=2.5, num_groups=4, topk_groups=2,
                                                              expert_bias=True),
                                          shared_expert=SharedExpertConfig(ffn_hidden=48))),
}
ARCH = {"mixtral": "MixtralForCausalLM", "mixtral-scaled": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM", "dots1": "Dots1ForCausalLM"}
COMMON_HF = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_experts_per_tok": 2, "max_position_embeddings": 64,
             "initializer_range": 0.1, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
HF = {
    "mixtral": {"intermediate_size": 24, "num_local_experts": 4},
    "qwen3_moe": {"intermediate_size": 40, "moe_intermediate_size": 24, "num_experts": 4, "norm_topk_prob": True,
                  "head_dim": 16, "mlp_only_layers": [0]},
    "olmoe": {"intermediate_size": 24, "num_experts": 4},
    "qwen2_moe": {"intermediate_size": 40, "moe_intermediate_size": 24, "num_experts": 4,
                  "shared_expert_intermediate_size": 20, "decoder_sparse_step": 2, "tie_word_embeddings": True},
    "dots1": {"intermediate_size": 40, "moe_intermediate_size": 16, "n_routed_experts": 8, "n_shared_experts": 2,
              "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
              "norm_topk_prob": True},
}
FAMILIES = list(HF)


@torch.no_grad()
def _our_model(family: str) -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(OURS[family]()).eval()
    for name, buf in model.named_buffers():  # a non-zero expert bias, so that it matters
        if "e_score_correction_bias" in name:
            buf.normal_(0.0, 0.05)
    return model


@torch.no_grad()
def _hf_model(family: str):
    torch.manual_seed(1)
    config = transformers.AutoConfig.for_model(family, **{**COMMON_HF, **HF[family]})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for name, p in model.named_parameters():  # HF zero-initialises some routers; give every router a real choice
        if name.endswith(("mlp.gate.weight",)):
            p.normal_(0.0, 0.5)
    for name, buf in model.named_buffers():
        if "e_score_correction_bias" in name:
            buf.normal_(0.0, 0.05)
    return model


def _prompt() -> torch.Tensor:
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))


def _greedy_hf(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf.generate(ids, do_sample=False, max_new_tokens=20, min_new_tokens=20, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("family", list(OURS))
def test_export_round_trip_and_transformers_parity(family, tmp_path):
    """ours -> HF directory -> ours is exact (to one rounding where a scaling factor is folded into the experts);
    transformers loads the directory with the same logits and tokens."""
    ours = _our_model(family)
    to_hf(ours, tmp_path, max_shard_size="40KB")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == family.split("-")[0] and config["architectures"] == [ARCH[family]]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    assert (tmp_path / "generation_config.json").is_file()

    back = from_hf(tmp_path)
    assert back.config == ours.config
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        if family == "mixtral-scaled" and name.endswith("experts.down_proj"):  # x 2.5 then / 2.5: one rounding
            torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=0)
        else:
            assert torch.equal(a[name], b[name]), name
    if ours.config.tie_embeddings:
        assert back.lm_head.weight is back.embed_tokens.weight

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCH[family]
    ids = _prompt()
    with torch.no_grad():
        diff = (ours(ids).logits - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
    torch.testing.assert_close(generate(ours, ids, 20, temperature=0.0), _greedy_hf(hf, ids), rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_hf_model_matches(family, tmp_path):
    """A random transformers model, imported from memory (fused experts) and from its saved directory (the hub's
    per-expert layout), gives the same logits and greedy tokens here."""
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path)
    ids = _prompt()
    with torch.no_grad():
        ref = hf(ids).logits
    ref_tokens = _greedy_hf(hf, ids)
    for source in (hf, tmp_path):
        ours = from_hf(source).eval()
        with torch.no_grad():
            diff = (ours(ids).logits - ref).abs().max().item()
        assert diff < 1e-4, (source, diff)
        torch.testing.assert_close(generate(ours, ids, 20, temperature=0.0), ref_tokens, rtol=0, atol=0)


def test_hub_layouts_are_read_by_name(tmp_path):
    """save_pretrained writes Mixtral experts as w1/w2/w3 and Qwen's as per-expert gate/up/down: both are read."""
    for family, probe in (("mixtral", "model.layers.0.block_sparse_moe.experts.0.w1.weight"),
                          ("qwen3_moe", "model.layers.1.mlp.experts.0.gate_proj.weight")):
        hf = _hf_model(family)
        hf.save_pretrained(tmp_path / family)
        index_or_file = tmp_path / family / "model.safetensors"
        from safetensors import safe_open

        with safe_open(str(index_or_file), "pt") as f:
            assert probe in f.keys()  # noqa: SIM118 (a safetensors handle, not a dict)
        ours = from_hf(tmp_path / family)
        hf_state = hf.state_dict()
        for i in ours.config.moe_layer_indices:
            assert torch.equal(ours.blocks[i].ffn.experts.gate_up_proj, hf_state[f"model.layers.{i}.mlp.experts.gate_up_proj"])


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_declared_layouts_round_trip_square_case(layout):
    """2F == D makes a fused [2F, D] block square: only the declared layout says which half is the gate."""
    e, d, f = 3, 8, 4
    gate_up, down = torch.randn(e, 2 * f, d), torch.randn(e, d, f)
    tensors = layout.write("p", gate_up, down)
    assert detect_layout(tensors, "p", (FUSED, PER_EXPERT, W123, MEGATRON)) is layout
    read = set()

    def get(name, shape):
        assert tuple(tensors[name].shape) == shape
        read.add(name)
        return tensors[name]

    gu, dn = layout.read(get, "p", e, d, f)
    assert torch.equal(gu, gate_up) and torch.equal(dn, down)
    assert read == set(tensors)  # read() reads exactly what write() wrote
    if layout is PER_EXPERT:  # gate is the first half: expert 1's gate_proj is rows 0..F-1 of its fused block
        assert torch.equal(tensors["p.1.gate_proj.weight"], gate_up[1, :f])
    if layout is W123:  # Mixtral: w1 = gate, w3 = up, w2 = down
        assert torch.equal(tensors["p.2.w3.weight"], gate_up[2, f:]) and torch.equal(tensors["p.0.w2.weight"], down[0])


# ---- errors ---------------------------------------------------------------------------------------------------

def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        from_hf(tmp_path)


@pytest.mark.parametrize("model_type, words", [("gpt2", "unsupported model_type 'gpt2'"),
                                               ("deepseek_v3", "multi-head latent attention")])
def test_unsupported_model_type(tmp_path, model_type, words):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ConfigError, match=words) as err:
        from_hf(tmp_path)
    assert "\n" not in str(err.value)


def test_tensor_shape_disagreeing_with_config(tmp_path):
    to_hf(_our_model("mixtral"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_key_value_heads"] = 4  # k_proj / v_proj would be [32, 32]; the file has [16, 32]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        from_hf(tmp_path)
    msg = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(16, 32)" in msg and "(32, 32)" in msg, msg


def test_unexpected_tensor_is_named(tmp_path):
    hf = _hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 2  # the file still has layer 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.2\."):
        from_hf(tmp_path)


@pytest.mark.parametrize("change, words", [
    ({"first_k_dense": 1}, "MixtralForCausalLM has an MoE FFN in every layer"),
    ({"moe": _moe(router=RouterConfig(norm_topk_prob=False))}, "norm_topk_prob=False: Mixtral always renormalises"),
    ({"moe_every": 0}, "no MoE layer"),
    ({"qk_norm": "full", "head_dim": 16}, "OLMoE's q/k norm spans hidden=32"),
])
def test_export_refuses_what_does_not_map(tmp_path, change, words):
    cfg = ModelConfig(**{**BASE, **change})
    with torch.device("meta"):
        model = MoETransformer(cfg)
    with pytest.raises(ConfigError, match=words):
        to_hf(model, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_import_refuses_what_does_not_map(tmp_path):
    hf = _hf_model("mixtral")
    hf.config.sliding_window = 8
    with pytest.raises(ConfigError, match="sliding_window=8"):
        from_hf(hf)
    hf.config.sliding_window = None
    hf.config.rope_parameters = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ConfigError, match="rope_type='linear'"):
        from_hf(hf)


def test_dots1_without_expert_bias_round_trips(tmp_path):
    """dots.llm1 always stores e_score_correction_bias; a model without one exports zeros and comes back without."""
    cfg = dataclasses.replace(OURS["dots1"](), moe=_moe(num_experts=8, router=RouterConfig(
        score_func="sigmoid", num_groups=4, topk_groups=2, expert_bias=False)))
    torch.manual_seed(0)
    ours = MoETransformer(cfg)
    to_hf(ours, tmp_path)
    back = from_hf(tmp_path)
    assert back.config == cfg and back.state_dict().keys() == ours.state_dict().keys()


def test_layer_plan_mapping():
    """Qwen's decoder_sparse_step / mlp_only_layers <-> our moe_every / first_k_dense, refusing holes."""
    from moetrain.interop.families import QWEN3_MOE, model_config_from_hf

    def plan(**kw):
        cfg = transformers.AutoConfig.for_model("qwen3_moe", **{**COMMON_HF, **HF["qwen3_moe"], "num_hidden_layers": 6,
                                                                 **kw})
        ours = model_config_from_hf(cfg, QWEN3_MOE)
        return ours.moe_layer_indices

    assert plan(decoder_sparse_step=1, mlp_only_layers=[]) == [0, 1, 2, 3, 4, 5]
    assert plan(decoder_sparse_step=2, mlp_only_layers=[]) == [1, 3, 5]
    assert plan(decoder_sparse_step=2, mlp_only_layers=[0, 1, 2]) == [3, 5]
    assert plan(decoder_sparse_step=1, mlp_only_layers=[0, 1]) == [2, 3, 4, 5]
    with pytest.raises(ConfigError, match="mlp_only_layers=\\[3\\]"):
        plan(decoder_sparse_step=1, mlp_only_layers=[3])


def test_export_keeps_a_model_trained_with_dropout(tmp_path):
    """Dropout (``model.dropout``, ``model.moe.experts.dropout``) is training-only: the export is the same model."""
    torch.manual_seed(0)
    plain = MoETransformer(OURS["mixtral"]())
    dropped = MoETransformer(dataclasses.replace(OURS["mixtral"](), dropout=0.1, moe=_moe(
        router=RouterConfig(norm_topk_prob=True), experts=ExpertsConfig(ffn_hidden=24, dropout=0.2))))
    dropped.load_state_dict(plain.state_dict())
    to_hf(plain, tmp_path / "plain")
    to_hf(dropped, tmp_path / "dropped")
    assert (json.loads((tmp_path / "plain" / "config.json").read_text())
            == json.loads((tmp_path / "dropped" / "config.json").read_text()))
