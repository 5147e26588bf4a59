"""Sparse upcycling: a dense checkpoint becomes an MoE whose experts all start as copies of the dense FFN
(Komatsuzaki et al., 2023, "Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints").

Legend: E = experts, K = top-k, D = hidden, F = FFN hidden.

Why the upcycled model computes exactly the dense function at initialisation: every expert equals the dense
SwiGLU FFN, and the gating weights are the top-k probabilities renormalised to sum to 1 (``norm_topk_prob``), so
``sum_k w_k * FFN(x) = FFN(x)`` whatever the router chooses; the router (initialised small and random) only has to
break the symmetry once training starts. A Qwen2 model (q/k/v biases) can only be written as Qwen2-MoE, which
always has a sigmoid-gated shared expert: it starts as a copy of the dense FFN with a zero output projection, so it
adds exactly 0 until trained.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import cast

import torch

from moetrain.configlib import FieldError
from moetrain.errors import ConfigError, MoetrainError
from moetrain.interop.hf import CONFIG_FILE, build_model, from_hf, read_hf_config, to_hf
from moetrain.model.config import ModelConfig
from moetrain.model.ffn import SwiGLU
from moetrain.model.transformer import MoETransformer
from moetrain.moe.config import ExpertsConfig, MoEConfig, RouterConfig, SharedExpertConfig
from moetrain.train.checkpoint import model_tensors

# Copied verbatim from the dense directory: the tokenizer and the generation defaults stay the dense model's.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def upcycled_config(dense: ModelConfig, num_experts: int, top_k: int, shared_expert: bool = False) -> ModelConfig:
    """The MoE config of an upcycled ``dense`` model: every block MoE, experts as wide as the dense FFN.

    Raises:
        ConfigError: ``dense`` already has MoE blocks, or E / K are invalid (named field).
    """
    if dense.moe_layer_indices:
        raise ConfigError(f"model.moe_every={dense.moe_every}: the model already has MoE blocks "
                          f"{dense.moe_layer_indices}; upcycling takes a dense model")
    shared = SharedExpertConfig(ffn_hidden=dense.ffn_hidden, gate=True) if shared_expert else SharedExpertConfig()
    try:
        moe = MoEConfig(num_experts=num_experts, top_k=top_k, experts=ExpertsConfig(ffn_hidden=dense.ffn_hidden),
                        router=RouterConfig(norm_topk_prob=True), shared_expert=shared)
    except FieldError as e:  # num_experts / top_k: name the command-line options
        flag = {"num_experts": "--experts", "top_k": "--top-k"}.get(e.field, f"model.moe.{e.field}")
        raise ConfigError(f"{flag}: {e.message}") from None
    return dataclasses.replace(dense, moe_every=1, first_k_dense=0, moe=moe)


@torch.no_grad()
def upcycle_model(dense: MoETransformer, num_experts: int, top_k: int, router_std: float = 0.02, seed: int = 0,
                  shared_expert: bool | None = None) -> MoETransformer:
    """An MoE copy of ``dense`` that computes the same function (up to float rounding of ``sum_k w_k = 1``).

    Args:
        dense: a model without MoE blocks (``moe_every=0``), e.g. from :func:`~moetrain.interop.hf.from_hf` of a
            Llama / Mistral / Qwen2 / Qwen3 checkpoint.
        num_experts: E.  top_k: K.
        router_std: router weights ~ Normal(0, router_std) (small: near-uniform routing to begin with).
        seed: seeds the router initialisation.
        shared_expert: add a gated shared expert that starts at zero output; ``None`` = only when the model has
            q/k/v biases (the Qwen2-MoE family needs it).
    Returns:
        The upcycled model, in ``dense``'s dtype, on the CPU.
    Raises:
        ConfigError: a model with MoE blocks, invalid E / K / router_std.
    """
    if not 0 < router_std < math.inf:  # written this way round so that nan fails too
        raise ConfigError(f"--router-std: must be finite and > 0, got {router_std}")
    cfg = upcycled_config(dense.config, num_experts, top_k,
                          dense.config.attention_bias if shared_expert is None else shared_expert)
    gen = torch.Generator().manual_seed(seed)
    out = {name: t.clone() for name, t in model_tensors(dense).items() if ".ffn." not in name}  # tied ones once
    e, d = num_experts, cfg.hidden
    for i, block in enumerate(dense.blocks):
        ffn = cast(SwiGLU, block.ffn)  # a dense model (upcycled_config checked): every block's FFN is a SwiGLU
        gate, up, down = ffn.gate_proj.weight.cpu(), ffn.up_proj.weight.cpu(), ffn.down_proj.weight.cpu()
        p = f"blocks.{i}.ffn"
        out[f"{p}.experts.gate_up_proj"] = torch.cat([gate, up]).expand(e, -1, -1).clone()  # [E, 2F, D]
        out[f"{p}.experts.down_proj"] = down.expand(e, -1, -1).clone()  # [E, D, F]
        out[f"{p}.router.weight"] = (torch.randn(e, d, generator=gen) * router_std).to(gate.dtype)
        if cfg.moe.shared_expert.ffn_hidden > 0:
            out[f"{p}.shared_expert.gate_proj.weight"] = gate.clone()
            out[f"{p}.shared_expert.up_proj.weight"] = up.clone()
            out[f"{p}.shared_expert.down_proj.weight"] = torch.zeros_like(down)
            out[f"{p}.shared_expert_gate.weight"] = torch.zeros(1, d, dtype=gate.dtype)
    return build_model(cfg, out, dtype=None)


def upcycle_hf(dense_dir: str | Path, out_dir: str | Path, num_experts: int, top_k: int, router_std: float = 0.02,
               seed: int = 0, max_shard_size: str | int = "5GB") -> Path:
    """Upcycle a dense Hugging Face checkpoint directory into an MoE one (``moetrain upcycle``).

    The result is written with :func:`~moetrain.interop.hf.to_hf` (Llama / Mistral -> Mixtral, Qwen3 -> Qwen3-MoE,
    Qwen2 -> Qwen2-MoE), in the dense checkpoint's dtype, with its tokenizer files and ``generation_config.json``
    copied and its bos / eos / pad token ids kept, so ``moetrain train --init-from OUT`` fine-tunes it.

    Raises:
        MoetrainError: a bad directory, an MoE or unsupported ``model_type``, a feature that does not map.
    """
    dense_dir, out = Path(dense_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise MoetrainError(f"{out}: exists and is not empty; choose another output directory")
    family, hf_cfg = read_hf_config(dense_dir)
    if family.moe:
        raise ConfigError(f"{dense_dir / CONFIG_FILE}: model_type '{family.model_type}' is already an MoE; upcycling "
                          "takes a dense llama / mistral / qwen2 / qwen3 checkpoint")
    dense = from_hf(dense_dir, dtype=None)
    model = upcycle_model(dense, num_experts, top_k, router_std, seed)
    to_hf(model, out, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        if (dense_dir / name).is_file():
            shutil.copyfile(dense_dir / name, out / name)
    config = json.loads((out / CONFIG_FILE).read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = getattr(hf_cfg, key, None)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
