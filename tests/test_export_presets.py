"""``moetrain export`` of a run of every preset: transformers loads the directory with the same logits (1e-4).

Each preset trains for one step at a reduced size that keeps its architecture's features (q/k norm, head_dim,
tied or untied embeddings, rope_theta, norm_eps, renormalised or raw top-k weights, the routed scaling factor,
experts per token); the reference is transformers' own modeling code on CPU in fp32."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moetrain.cli import main
from moetrain.commands.run_dir import load_run
from moetrain.presets import PRESETS

COMMON = ["--steps", "1", "--no-progress", "train.eval_every=0", "train.eval_batches=1", "train.batch_size=2",
          "train.warmup_steps=0", "data.seq_len=32", "model.vocab_size=320", "model.max_seq_len=64"]
SMALL = ["model.hidden=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=48"]
# Preset -> the size reductions (features untouched) and the transformers class its export must become.
REDUCED = {
    "tiny": ([], "MixtralForCausalLM"),
    "cpu-small": ([*SMALL, "model.moe.experts.ffn_hidden=24"], "MixtralForCausalLM"),
    "mixtral-8x7b": ([*SMALL, "model.moe.experts.ffn_hidden=48"], "MixtralForCausalLM"),
    "qwen3-30b-a3b": ([*SMALL, "model.head_dim=16", "model.moe.num_experts=16", "model.moe.experts.ffn_hidden=16"],
                      "Qwen3MoeForCausalLM"),
    "olmoe-1b-7b": ([*SMALL, "model.n_kv_heads=4", "model.moe.num_experts=16", "model.moe.experts.ffn_hidden=16"],
                    "OlmoeForCausalLM"),
}


def test_every_preset_is_covered():
    assert sorted(REDUCED) == sorted(PRESETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_export_of_a_run_of_every_preset(preset, tmp_path, code_corpus, capsys):
    overrides, architecture = REDUCED[preset]
    run = tmp_path / "run"
    assert main(["train", "--preset", preset, "--data", str(code_corpus), "--out", str(run), *COMMON,
                 *overrides]) == 0
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", str(out)]) == 0
    assert architecture in capsys.readouterr().out

    config, tok, ours, _ = load_run(str(run))
    preset_moe = PRESETS[preset]["model"].get("moe", {})
    # The features the reduction keeps (the one a Mixtral export once refused included).
    for key, value in preset_moe.get("router", {}).items():
        assert getattr(config.model.moe.router, key) == value, key
    assert config.model.moe.top_k == preset_moe["top_k"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    ids = torch.tensor([tok.encode("def function_1_2(value, count=2):\n    return value * 2").ids])
    with torch.no_grad():
        diff = (ours(ids).logits - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
