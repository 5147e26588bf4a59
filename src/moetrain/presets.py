"""Named configurations.

``tiny`` trains in seconds (tests); ``cpu-small`` is the default job (8 experts, top-2, 1.36M parameters of which
0.77M active, 600 steps; the MoE that beats its dense twin on its budget, docs/moe-vs-dense.md); ``mixtral-8x7b``,
``qwen3-30b-a3b`` and ``olmoe-1b-7b`` are shape-only presets with the published architectures (their HF
``config.json``), for parameter counting and planning on the meta device.
"""

from __future__ import annotations

import copy
from typing import Any

from moetrain.errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {
            "vocab_size": 512, "hidden": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
            "max_seq_len": 128,
            "moe": {"num_experts": 4, "top_k": 2, "experts": {"ffn_hidden": 64}},
        },
        "data": {"seq_len": 64, "tokenizer_max_bytes": 2_000_000},
        "train": {
            "steps": 30, "batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "eval_every": 15, "eval_batches": 2,
            "log_every": 5, "ckpt_every": 15,
        },
    },
    "cpu-small": {
        # The MoE that beats its dense twin (model.moe_every=0) on this budget; each value and why:
        # docs/moe-vs-dense.md, "The recipe".
        "model": {
            "vocab_size": 8192, "hidden": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 256,
            "max_seq_len": 1024,
            "moe": {"num_experts": 8, "top_k": 2, "experts": {"ffn_hidden": 128}, "losses": {"aux_loss_coeff": 0.02},
                    "router": {"routed_scaling_factor": 2.0}},
        },
        "data": {"seq_len": 256},
        "train": {
            "steps": 600, "batch_size": 16, "lr": 3e-3, "warmup_steps": 60, "eval_every": 100, "eval_batches": 8,
            "log_every": 10, "ckpt_every": 100, "router_lr_scale": 0.1, "expert_weight_decay": 1.0,
        },
    },
    # mistralai/Mixtral-8x7B-v0.1 config.json
    "mixtral-8x7b": {
        "model": {
            "vocab_size": 32000, "hidden": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
            "ffn_hidden": 14336, "tie_embeddings": False, "rope_theta": 1e6, "max_seq_len": 32768,
            "norm_eps": 1e-5,
            "moe": {"num_experts": 8, "top_k": 2, "experts": {"ffn_hidden": 14336},
                    "router": {"norm_topk_prob": True}},
        },
    },
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": {
        "model": {
            "vocab_size": 151936, "hidden": 2048, "n_layers": 48, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128,
            "ffn_hidden": 6144, "qk_norm": "head", "tie_embeddings": False, "rope_theta": 1e6,
            "max_seq_len": 40960,
            "moe": {"num_experts": 128, "top_k": 8, "experts": {"ffn_hidden": 768},
                    "router": {"norm_topk_prob": True}},
        },
    },
    # allenai/OLMoE-1B-7B-0924 config.json
    "olmoe-1b-7b": {
        "model": {
            "vocab_size": 50304, "hidden": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 16,
            "ffn_hidden": 1024, "qk_norm": "full", "tie_embeddings": False, "rope_theta": 10000.0,
            "max_seq_len": 4096, "norm_eps": 1e-5,
            "moe": {"num_experts": 64, "top_k": 8, "experts": {"ffn_hidden": 1024},
                    "router": {"norm_topk_prob": False}},
        },
    },
}

SHAPE_ONLY = ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b")


def preset_dict(name: str) -> dict[str, Any]:
    """A deep copy of preset ``name`` as plain data (with ``preset`` set).

    Raises:
        ConfigError: unknown preset name.
    """
    if name not in PRESETS:
        raise ConfigError(f"--preset {name}: unknown preset; choose one of {sorted(PRESETS)}")
    data = copy.deepcopy(PRESETS[name])
    data["preset"] = name
    return data
