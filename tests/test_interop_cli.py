"""End to end through the CLI: export a trained run and load it in transformers; upcycle a dense transformers
checkpoint (same logits at initialisation) and fine-tune it with ``moetrain train --init-from``; one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moetrain.cli import main
from moetrain.commands.run_dir import load_run
from moetrain.data.tokenizer import EOS_TOKEN, train_tokenizer
from moetrain.interop.hf import from_hf
from moetrain.interop.upcycle import upcycle_model

TRAIN = ["--no-progress", "train.eval_every=0", "train.eval_batches=1", "train.batch_size=4", "data.seq_len=32",
         "train.log_every=1"]


def _one_line_error(capsys, argv: list[str], *words: str) -> None:
    capsys.readouterr()  # drop earlier output (transformers' progress bars)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("moetrain: error:"), err
    for w in words:
        assert w in err, err


def test_export_trained_run(tmp_path, code_corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(code_corpus), "--out", str(run), "--steps", "2", *TRAIN]) == 0
    out = tmp_path / "hf"
    capsys.readouterr()
    try:
        assert main(["export", str(run), "--format", "hf", str(out)]) == 0
        err = capsys.readouterr().err  # not a terminal: no progress bar of transformers' save_pretrained
        assert "it/s]" not in err and "\r" not in err, err
    finally:
        transformers.utils.logging.enable_progress_bar()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    assert (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file()
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}  # weights as readable as config.json
    assert len(set(modes.values())) == 1 and modes["config.json"] & 0o044, modes

    _, tok, ours, _ = load_run(str(run))
    text = "def function_1_2(value, count=2):\n    return value * 2"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text).ids
    assert hf_tok.eos_token == EOS_TOKEN and json.loads((out / "generation_config.json").read_text())[
        "eos_token_id"] == tok.token_to_id(EOS_TOKEN)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 1e-4

    _one_line_error(capsys, ["export", str(run), "--format", "hf", str(out)], "exists and is not empty")
    _one_line_error(capsys, ["export", str(tmp_path / "nope"), str(tmp_path / "o2")], "not found")


def _dense_checkpoint(root: Path, corpus: Path, model_type: str) -> Path:
    """A random dense transformers model with a byte-level BPE tokenizer trained on the corpus."""
    texts = [p.read_text() for p in sorted(corpus.iterdir())]
    tok = train_tokenizer(texts, 300)
    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1,
        bos_token_id=None, eos_token_id=0, pad_token_id=None, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if model_type == "qwen2":  # non-zero q/k/v biases, so that they matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0.0, 0.1)
    model.save_pretrained(root)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN).save_pretrained(root)
    return root


def test_upcycle_then_finetune(tmp_path, code_corpus, capsys):
    dense_dir = _dense_checkpoint(tmp_path / "dense", code_corpus, "llama")
    up = tmp_path / "moe"
    assert main(["upcycle", str(dense_dir), str(up), "--experts", "4", "--top-k", "2"]) == 0

    dense = transformers.AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    hf_moe = transformers.AutoModelForCausalLM.from_pretrained(up, dtype=torch.float32).eval()
    assert type(hf_moe).__name__ == "MixtralForCausalLM"
    ours = from_hf(up).eval()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = dense(ids).logits
        assert (ours(ids).logits - ref).abs().max().item() < 1e-5
        assert (hf_moe(ids).logits - ref).abs().max().item() < 1e-5
    # The router is small and random, and every expert is a copy of the dense FFN.
    ffn = dense.model.layers[0].mlp
    experts = ours.blocks[0].ffn.experts
    assert torch.equal(experts.gate_up_proj[3], torch.cat([ffn.gate_proj.weight, ffn.up_proj.weight]))
    assert 0 < ours.blocks[0].ffn.router.weight.std().item() < 0.05

    run = tmp_path / "run"
    # A negligible learning rate: after a few real steps the weights must still be the upcycled ones (proves the
    # run started from them, not from a random initialisation).
    argv = ["train", "--preset", "tiny", "--init-from", str(up), "--data", str(code_corpus), "--out", str(run),
            "--steps", "3", *TRAIN, "train.lr=1e-12", "train.warmup_steps=0"]
    assert main(argv) == 0
    assert (run / "tokenizer.json").read_bytes() == (up / "tokenizer.json").read_bytes() or json.loads(
        (run / "tokenizer.json").read_text()) == json.loads((up / "tokenizer.json").read_text())
    losses = [json.loads(line)["train_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "train_loss" in line]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    config, _, trained, _ = load_run(str(run))
    assert config.model == ours.config
    for name, t in ours.state_dict().items():
        torch.testing.assert_close(trained.state_dict()[name], t, atol=1e-6, rtol=0)

    _one_line_error(capsys, ["upcycle", str(up), str(tmp_path / "again"), "--experts", "4", "--top-k", "2"],
                    "already an MoE")
    _one_line_error(capsys, ["upcycle", str(dense_dir), str(tmp_path / "x"), "--experts", "2", "--top-k", "3"],
                    "--top-k")
    for std in ("nan", "inf"):  # nan passed `<= 0` and wrote NaN router weights
        _one_line_error(capsys, ["upcycle", str(dense_dir), str(tmp_path / "x"), "--experts", "4", "--top-k", "2",
                                 "--router-std", std], "--router-std", std)
        assert not (tmp_path / "x").exists()
    _one_line_error(capsys, ["train", "--preset", "tiny", "--init-from", str(up), "--out", str(tmp_path / "r2"),
                              "model.hidden=64"],
                    "model.hidden=64", "--init-from")
    (up / "tokenizer.json").unlink()
    _one_line_error(capsys, ["train", "--init-from", str(up), "--out", str(tmp_path / "r3")], "no tokenizer.json")
    _one_line_error(capsys, ["train", "--init-from", str(tmp_path / "nothing"), "--out", str(tmp_path / "r4")],
                    "no such directory")


@pytest.mark.parametrize("model_type, family", [("qwen3", "Qwen3MoeForCausalLM"), ("qwen2", "Qwen2MoeForCausalLM")])
def test_upcycled_logits_equal_dense(tmp_path, code_corpus, model_type, family):
    """Qwen3 -> Qwen3-MoE; Qwen2 (q/k/v biases) -> Qwen2-MoE, whose gated shared expert starts at zero output."""
    dense_dir = _dense_checkpoint(tmp_path / "dense", code_corpus, model_type)
    dense = transformers.AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    moe = upcycle_model(from_hf(dense_dir), num_experts=4, top_k=2).eval()
    assert moe.config.moe_layer_indices == [0, 1]
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    from moetrain.interop.hf import to_hf

    to_hf(moe, tmp_path / "moe")
    hf_moe = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).eval()
    assert type(hf_moe).__name__ == family
    with torch.no_grad():
        ref = dense(ids).logits
        assert (moe(ids).logits - ref).abs().max().item() < 1e-5
        assert (hf_moe(ids).logits - ref).abs().max().item() < 1e-5


def test_init_from_leaves_out_the_presets_from_scratch_expert_decay():
    """cpu-small's experts decay at 1.0 (a recipe for training from random weights, wave 11): a fine-tune of a
    pretrained model gets the default (the experts decay like the rest) and a note, unless it asks for the value."""
    from moetrain.config import build_config
    from moetrain.configlib import parse_overrides
    from moetrain.interop.finetune import InitFrom

    init = InitFrom(model=build_config("cpu-small").model, weights={}, tokenizer=Path("tokenizer.json"))
    assert build_config("cpu-small").train.expert_weight_decay == 1.0  # what the preset sets
    config, notes = init.config("cpu-small", None, {})
    assert config.train.expert_weight_decay is None and config.train.weight_decay == 0.1
    assert len(notes) == 1 and "train.expert_weight_decay" in notes[0] and "'cpu-small'" in notes[0], notes
    assert config.train.router_lr_scale == 0.1 and config.train.lr == 3e-3  # the rest of the preset stays
    for given in ({"train": {"expert_weight_decay": 1.0}}, None):  # an override, or a --config file, keeps it
        overrides = parse_overrides(["train.expert_weight_decay=1.0"]) if given is None else {}
        config, notes = init.config("cpu-small", given, overrides)
        assert config.train.expert_weight_decay == 1.0 and notes == []
    config, notes = init.config("tiny", None, {})  # a preset without it: nothing to say
    assert config.train.expert_weight_decay is None and notes == []
