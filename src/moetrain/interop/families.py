"""Hugging Face model families: how our :class:`ModelConfig` maps to each family's ``config.json`` and back, and
what each family calls our tensors.

A family is chosen from the model's configuration (:func:`family_for`). What has no faithful equivalent on the
other side is refused with a :class:`ConfigError` naming the feature, never approximated: an exported model must
give the same logits in transformers, and an imported one the same logits here.

The field correspondences are :func:`hf_config_dict` (ours -> HF) and :func:`model_config_from_hf` (back);
``moe.losses.aux_loss_coeff`` is ``router_aux_loss_coef * top_k`` (transformers' load-balancing loss counts each token
K times, see moe/losses.py). Training-only fields with no HF field travel in the ``moetrain`` key of ``config.json``
(transformers keeps unknown keys and ignores them).

``moe.router.routed_scaling_factor`` is folded into the routed experts' ``down_proj`` on export where the family has
no such field (:func:`fold_routed_scale`), carried in ``config.json["moetrain"]`` and divided back out on import.

Layer plans: ours is "block i is MoE iff i >= first_k_dense and (i + 1) % moe_every == 0"; Qwen2/3-MoE's
``decoder_sparse_step`` is ``moe_every`` and ``mlp_only_layers`` must be a prefix (-> ``first_k_dense``); dots.llm1's
``first_k_dense_replace`` is ``first_k_dense``; Mixtral and OLMoE are MoE in every layer.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Literal

from moetrain.configlib import from_dict
from moetrain.errors import ConfigError
from moetrain.interop.layouts import FUSED, PER_EXPERT, W123, ExpertLayout
from moetrain.model.config import ModelConfig
from moetrain.moe.config import MoEConfig

# Fields (paths under ``model.``; a table covers its fields) that change training or execution, not the function the
# model computes: they never block an export. Those in CARRIED travel in config.json["moetrain"]; the rest (the
# initialisation, the execution choices such as the backend) stay local.
# Dropout is the identity at inference, so an exported model computes the same function without it.
TRAINING_ONLY = ("init_std", "execution", "moe.losses", "moe.router.expert_bias_update_rate", "dropout",
                 "moe.experts.dropout")
# config.json["moetrain"] key -> our field under model.moe. The keys are the exported format (older exports wrote
# them too), so they keep their names when our fields move.
CARRIED = {
    **{name: f"losses.{name}" for name in ("aux_loss_coeff", "pooled_aux_loss_coeff", "seq_aux_loss_coeff",
                                           "global_aux_loss_coeff", "z_loss_coeff", "util_loss_coeff")},
    "expert_bias_update_rate": "router.expert_bias_update_rate",
}


def training_only(path: str) -> bool:
    """Whether the field ``path`` under ``model.`` (``moe.losses.z_loss_coeff``) is in :data:`TRAINING_ONLY`."""
    return any(path == p or path.startswith(p + ".") for p in TRAINING_ONLY)


def flat_fields(config: Any, prefix: str = "") -> dict[str, Any]:
    """A config dataclass's leaf fields by dotted path (nested configs flattened): ``{"moe.top_k": 2, ...}``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_fields(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


@dataclass(frozen=True)
class Family:
    """One transformers architecture.

    Attributes:
        model_type: ``config.json``'s ``model_type``.
        architecture: the ``*ForCausalLM`` class name.
        moe: False for the dense families (read only, as the source of sparse upcycling).
        num_experts_key / expert_ffn_key: the config keys holding E and F.
        dense_ffn_key: the config key holding the dense FFN width, or ``None`` (every layer is MoE).
        qk_norm: the family's q/k norm (``none`` / ``head`` / ``full``).
        disk_layouts: expert layouts its checkpoints may use, in the order they are probed (names decide).
        legacy_moe_name: the MoE block's name in checkpoints of the ``w123`` layout (Mixtral: ``block_sparse_moe``).
        shared_name: the family's name of the shared expert module (ours: ``shared_expert``).
        fixed: ``config.json`` keys an export always writes with these values (features we do not have, off).
    """

    model_type: str
    architecture: str
    moe: bool = True
    num_experts_key: str = "num_experts"
    expert_ffn_key: str = "moe_intermediate_size"
    dense_ffn_key: str | None = "intermediate_size"
    qk_norm: Literal["none", "head", "full"] = "none"
    disk_layouts: tuple[ExpertLayout, ...] = (FUSED, PER_EXPERT)
    legacy_moe_name: str | None = None
    shared_name: str = "shared_expert"
    fixed: Mapping[str, Any] = field(default_factory=dict)


MIXTRAL = Family("mixtral", "MixtralForCausalLM", num_experts_key="num_local_experts",
                 expert_ffn_key="intermediate_size", dense_ffn_key=None, disk_layouts=(FUSED, W123),
                 legacy_moe_name="block_sparse_moe", fixed={"sliding_window": None, "router_jitter_noise": 0.0})
QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", fixed={"use_sliding_window": False})
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm="head",
                   fixed={"attention_bias": False, "use_sliding_window": False})
OLMOE = Family("olmoe", "OlmoeForCausalLM", expert_ffn_key="intermediate_size", dense_ffn_key=None, qk_norm="full",
               fixed={"attention_bias": False, "clip_qkv": None})
DOTS1 = Family("dots1", "Dots1ForCausalLM", num_experts_key="n_routed_experts", qk_norm="head",
               shared_name="shared_experts", fixed={"attention_bias": False, "sliding_window": None})
FAMILIES: dict[str, Family] = {f.model_type: f for f in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DOTS1)}

LLAMA = Family("llama", "LlamaForCausalLM", moe=False)
MISTRAL = Family("mistral", "MistralForCausalLM", moe=False)
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", moe=False)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", moe=False, qk_norm="head")
DENSE_FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3)}

# Families we recognise but cannot represent, with the feature that does not map.
REFUSED_TYPES = {
    "deepseek_v3": "multi-head latent attention (kv_lora_rank / q_lora_rank) does not map: moetrain attention is "
                   "grouped-query attention (the DeepSeek-V3 router itself is supported, e.g. through dots1)",
    "deepseek_v2": "multi-head latent attention (kv_lora_rank) does not map: moetrain attention is grouped-query "
                   "attention",
}


def _err(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{field}={value!r}: {why}")


# ---- ours -> HF -----------------------------------------------------------------------------------------------

def _check_defaults(cfg: ModelConfig, handled: set[str], family: str) -> None:
    """Refuse any field outside ``handled`` (paths under ``model.``) and :data:`TRAINING_ONLY` whose value differs
    from its default (a feature that does not map)."""
    defaults = flat_fields(ModelConfig())
    for path, value in flat_fields(cfg).items():
        if path in handled or training_only(path):
            continue
        if value != defaults[path]:
            raise _err(f"model.{path}", value, f"has no equivalent in the Hugging Face {family} format")


def family_for(cfg: ModelConfig) -> Family:
    """The HF family that represents ``cfg`` exactly.

    Chosen from the router and the attention: a sigmoid router (DeepSeek-V3 style) -> dots.llm1; otherwise q/k
    RMSNorm over the whole projection -> OLMoE, per head -> Qwen3-MoE; no q/k norm and a shared expert or q/k/v
    biases -> Qwen2-MoE; else Mixtral.

    Raises:
        ConfigError: naming the first feature of ``cfg`` with no faithful equivalent in that family.
    """
    if not cfg.moe_layer_indices:
        raise _err("model.moe_every", cfg.moe_every, "the model has no MoE layer; the export formats are MoE families")
    moe = cfg.moe
    if moe.router.score_func == "sigmoid":
        family = DOTS1
    elif cfg.qk_norm == "full":
        family = OLMOE
    elif cfg.qk_norm == "head":
        family = QWEN3_MOE
    elif moe.shared_expert.ffn_hidden > 0 or cfg.attention_bias:
        family = QWEN2_MOE
    else:
        family = MIXTRAL
    _check_family(cfg, family)
    return family


def _check_family(cfg: ModelConfig, family: Family) -> None:
    name, moe = family.architecture, cfg.moe
    handled_model = {"vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "qk_norm",
                     "tie_embeddings", "rope_theta", "max_seq_len", "norm_eps", "moe_every", "first_k_dense",
                     "attention_bias"}
    handled_moe = {"num_experts", "top_k", "experts.ffn_hidden", "router.norm_topk_prob", "shared_expert.ffn_hidden",
                   "shared_expert.gate", "router.routed_scaling_factor"}
    if family is DOTS1:
        handled_moe |= {"router.score_func", "router.num_groups", "router.topk_groups", "router.expert_bias"}
    _check_defaults(cfg, handled_model | {f"moe.{p}" for p in handled_moe}, name)
    if cfg.qk_norm != family.qk_norm:
        raise _err("model.qk_norm", cfg.qk_norm, f"{name} has qk_norm {family.qk_norm!r}")
    if cfg.attention_bias and family is not QWEN2_MOE:
        raise _err("model.attention_bias", True, f"{name} has no q/k/v biases (Qwen2-MoE has; it needs qk_norm "
                   "'none' and the softmax router)")
    shared, gated = moe.shared_expert.ffn_hidden, moe.shared_expert.gate
    if family is QWEN2_MOE and not (shared > 0 and gated):
        raise _err("model.moe.shared_expert.gate", gated, "Qwen2-MoE (the family with q/k/v biases) always has a "
                   "sigmoid-gated shared expert")
    if family in (MIXTRAL, QWEN3_MOE, OLMOE) and shared > 0:
        raise _err("model.moe.shared_expert.ffn_hidden", shared, f"{name} has no shared expert")
    if family is DOTS1:
        if gated:
            raise _err("model.moe.shared_expert.gate", True, "dots.llm1's shared experts are not gated")
        if shared % moe.experts.ffn_hidden:
            raise _err("model.moe.shared_expert.ffn_hidden", shared, "dots.llm1 sizes the shared expert as "
                       f"n_shared_experts * moe_intermediate_size; it must be a multiple of {moe.experts.ffn_hidden}")
        if moe.num_experts // moe.router.num_groups < 2:
            raise _err("model.moe.router.num_groups", moe.router.num_groups, "dots.llm1 scores a group by its two "
                       "best experts, so groups need >= 2 experts")
        if cfg.moe_every != 1:
            raise _err("model.moe_every", cfg.moe_every, "dots.llm1 has MoE in every layer after "
                       "first_k_dense_replace")
    every_layer_moe = len(cfg.moe_layer_indices) == cfg.n_layers
    if family.dense_ffn_key is None and not every_layer_moe:
        dense = [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)]
        raise _err("model.moe_every / first_k_dense", (cfg.moe_every, cfg.first_k_dense),
                   f"{name} has an MoE FFN in every layer; dense blocks {dense} do not map")
    if family is MIXTRAL and not moe.router.norm_topk_prob:
        raise _err("model.moe.router.norm_topk_prob", False, "Mixtral always renormalises the top-k weights "
                   "(Qwen2/3-MoE and OLMoE have the flag)")
    if family is OLMOE and cfg.head_size * cfg.n_heads != cfg.hidden:
        raise _err("model.head_dim", cfg.head_dim, f"OLMoE's q/k norm spans hidden={cfg.hidden} features, so "
                   f"n_heads * head_dim must equal hidden (got {cfg.n_heads} * {cfg.head_size})")


def hf_config_dict(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """``cfg`` as keyword arguments of ``family``'s transformers config class (after :func:`family_for`)."""
    moe, router = cfg.moe, cfg.moe.router
    out: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_size,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "attention_dropout": 0.0,
        "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.losses.aux_loss_coeff / moe.top_k,
        family.num_experts_key: moe.num_experts, family.expert_ffn_key: moe.experts.ffn_hidden,
        "moetrain": {key: attrgetter(path)(moe) for key, path in CARRIED.items()}, **family.fixed,
    }
    if family.dense_ffn_key is not None:
        out[family.dense_ffn_key] = cfg.ffn_hidden
    else:  # unused by an all-MoE model; carried so that a round trip gives back the same config
        out["moetrain"]["ffn_hidden"] = cfg.ffn_hidden
    if family is not MIXTRAL:  # Mixtral always renormalises
        out["norm_topk_prob"] = router.norm_topk_prob
    if family in (QWEN2_MOE, QWEN3_MOE):
        out.update(decoder_sparse_step=cfg.moe_every, mlp_only_layers=list(range(min(cfg.first_k_dense, cfg.n_layers))))
    if family is QWEN2_MOE:
        out.update(qkv_bias=cfg.attention_bias, shared_expert_intermediate_size=moe.shared_expert.ffn_hidden)
    elif family is OLMOE:
        del out["head_dim"]  # OLMoE derives it from hidden_size // num_attention_heads (checked equal)
    if family is DOTS1:
        out.update(first_k_dense_replace=min(cfg.first_k_dense, cfg.n_layers),
                   n_shared_experts=moe.shared_expert.ffn_hidden // moe.experts.ffn_hidden,
                   routed_scaling_factor=router.routed_scaling_factor, n_group=router.num_groups,
                   topk_group=router.groups_per_token, layer_types=["full_attention"] * cfg.n_layers)
        # dots.llm1 always has e_score_correction_bias (zeros without one): say whether ours has the bias, so that
        # an import gives back the same config (and the bias updates only where they were on).
        out["moetrain"]["expert_bias"] = router.expert_bias
    elif router.routed_scaling_factor != 1.0:  # folded into down_proj (fold_routed_scale)
        out["moetrain"]["routed_scaling_factor"] = router.routed_scaling_factor
    return out


# ---- HF -> ours -----------------------------------------------------------------------------------------------

def _get(hf: Any, key: str, default: Any = None) -> Any:
    value = getattr(hf, key, default)
    return default if value is None else value


def _layer_plan(hf: Any, n_layers: int) -> tuple[int, int]:
    """(moe_every, first_k_dense) reproducing HF's ``decoder_sparse_step`` / ``mlp_only_layers`` /
    ``first_k_dense_replace`` plan exactly.

    Raises:
        ConfigError: a plan our (moe_every, first_k_dense) cannot express.
    """
    step = int(_get(hf, "decoder_sparse_step", 1))
    mlp_only = sorted(set(_get(hf, "mlp_only_layers", [])))
    first_k = int(_get(hf, "first_k_dense_replace", 0))
    hf_moe = [i for i in range(n_layers) if i not in mlp_only and i >= first_k and (i + 1) % step == 0]
    candidates = [i for i in range(n_layers) if (i + 1) % step == 0]
    removed = [i for i in candidates if i not in hf_moe]
    k = (removed[-1] + 1) if removed else 0
    if mlp_only == list(range(len(mlp_only))):
        k = max(k, len(mlp_only))
    k = max(k, first_k)
    if [i for i in candidates if i >= k] != hf_moe:
        raise _err("mlp_only_layers", mlp_only, f"with decoder_sparse_step={step} the MoE layers {hf_moe} cannot be "
                   "expressed by moetrain's layer plan (every moe_every-th layer after the first first_k_dense)")
    return step, k


# HF config keys that map only at these values (a missing or null key is the value), with why.
_ONLY_VALUES = {
    "hidden_act": ("silu", "moetrain FFNs and experts are SwiGLU (silu)"),
    "attention_dropout": (0.0, "moetrain attention has no dropout"),
    "router_jitter_noise": (0.0, "transformers jitters the hidden states in place (moetrain's router.jitter_eps "
                                 "scales the router input only)"),
    "clip_qkv": (None, "moetrain attention does not clip q/k/v"),
    "mlp_bias": (False, "moetrain FFNs have no biases"),
}


def _refuse_common(hf: Any, family: Family) -> None:
    rope = _get(hf, "rope_parameters", {})
    if rope.get("rope_type", "default") != "default":
        raise _err("rope_parameters.rope_type", rope.get("rope_type"), "moetrain implements plain RoPE only")
    for key, (only, why) in _ONLY_VALUES.items():
        if _get(hf, key, only) != only:
            raise _err(key, _get(hf, key), why)
    # Families with per-layer ``layer_types`` slide only on "sliding_attention" layers; the others slide
    # everywhere once ``sliding_window`` is set.
    layer_types = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)
    if ("sliding_attention" in layer_types) if layer_types is not None else window is not None:
        raise _err("sliding_window", window, "moetrain attention is full causal attention (no sliding window)")
    if family.model_type not in ("mixtral", "qwen2", "qwen2_moe") and _get(hf, "attention_bias", False):
        raise _err("attention_bias", True, f"{family.architecture} adds a bias to o_proj too; moetrain has q/k/v "
                   "biases only")


def _moe_from_hf(hf: Any, family: Family, carried: dict[str, Any]) -> MoEConfig:
    t = family.model_type
    num_experts = int(_get(hf, family.num_experts_key, 0))
    if num_experts < 1:
        raise _err(family.num_experts_key, num_experts, "the model has no experts")
    top_k = int(hf.num_experts_per_tok)
    ffn_hidden = int(_get(hf, family.expert_ffn_key))
    router: dict[str, Any] = {"norm_topk_prob": True if t == "mixtral" else bool(_get(hf, "norm_topk_prob", False))}
    data: dict[str, Any] = {
        "num_experts": num_experts, "top_k": top_k, "experts": {"ffn_hidden": ffn_hidden}, "router": router,
        "losses": {"aux_loss_coeff": float(_get(hf, "router_aux_loss_coef", 0.001)) * top_k},
    }
    for key, path in CARRIED.items():
        if key in carried:
            section, name = path.split(".")
            data.setdefault(section, {})[name] = carried[key]
    if t != "dots1" and "routed_scaling_factor" in carried:  # folded into down_proj by the export
        router["routed_scaling_factor"] = float(carried["routed_scaling_factor"])
    if t == "qwen2_moe":
        data["shared_expert"] = {"ffn_hidden": int(_get(hf, "shared_expert_intermediate_size", 0)), "gate": True}
    elif t == "dots1":
        groups, topk_groups = int(_get(hf, "n_group", 1)), int(_get(hf, "topk_group", 1))
        router.update(score_func="sigmoid", routed_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0)),
                      num_groups=groups, topk_groups=None if topk_groups >= groups else topk_groups,
                      expert_bias=bool(carried.get("expert_bias", True)))
        data["shared_expert"] = {"ffn_hidden": int(_get(hf, "n_shared_experts", 0)) * ffn_hidden}
    return from_dict(MoEConfig, data, "model.moe")


def model_config_from_hf(hf: Any, family: Family) -> ModelConfig:
    """Our :class:`ModelConfig` for a transformers config object of ``family`` (dense families: ``moe_every=0``).

    Raises:
        ConfigError: naming the HF field whose value has no faithful equivalent here.
    """
    _refuse_common(hf, family)
    t = family.model_type
    n_layers = int(hf.num_hidden_layers)
    hidden, n_heads = int(hf.hidden_size), int(hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and hidden % n_heads == 0 and int(head_dim) == hidden // n_heads:
        head_dim = None
    carried = _get(hf, "moetrain", {})
    if family.moe:
        moe = _moe_from_hf(hf, family, carried)
        if family.dense_ffn_key is None:
            moe_every, first_k = 1, 0
            ffn_hidden = int(carried.get("ffn_hidden", moe.experts.ffn_hidden))
        else:
            moe_every, first_k = _layer_plan(hf, n_layers)
            ffn_hidden = int(_get(hf, family.dense_ffn_key))
    else:
        moe, moe_every, first_k, ffn_hidden = MoEConfig(), 0, 0, int(hf.intermediate_size)
    # Qwen2Attention hard-codes q/k/v biases; Qwen2-MoE has the flag.
    attention_bias = t == "qwen2" or (t == "qwen2_moe" and bool(_get(hf, "qkv_bias", False)))
    rope = _get(hf, "rope_parameters", {})
    return ModelConfig(
        vocab_size=int(hf.vocab_size), hidden=hidden, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(_get(hf, "num_key_value_heads", n_heads)),
        head_dim=None if head_dim is None else int(head_dim), ffn_hidden=ffn_hidden, qk_norm=family.qk_norm,
        attention_bias=attention_bias, tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", _get(hf, "rope_theta", 10000.0))),
        max_seq_len=int(hf.max_position_embeddings), norm_eps=float(hf.rms_norm_eps),
        moe_every=moe_every, first_k_dense=first_k, init_std=float(_get(hf, "initializer_range", 0.02)), moe=moe,
    )


def fold_routed_scale(tensors: dict[str, Any], cfg: ModelConfig, family: Family, *, inverse: bool = False
                      ) -> dict[str, Any]:
    """``tensors`` (our names) with every routed expert's ``down_proj`` [E, D, F] multiplied by the router's
    ``routed_scaling_factor`` where ``family`` has no such field (all but dots.llm1; divided with ``inverse``, for an
    import); other tensors are passed through unchanged.

    Exact up to one rounding per weight (none for a power of two such as the ``cpu-small`` preset's 2.0): the
    gating weight multiplies the expert's output ``down @ h``, which is linear in ``down``.
    """
    scale = 1.0 if family is DOTS1 else cfg.moe.router.routed_scaling_factor
    if scale == 1.0:
        return tensors
    return {name: ((t / scale) if inverse else (t * scale)) if name.endswith(".ffn.experts.down_proj") else t
            for name, t in tensors.items()}


# ---- tensor names ---------------------------------------------------------------------------------------------

_RULES: tuple[tuple[str, str], ...] = (
    (r"^embed_tokens\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^blocks\.(\d+)\.input_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blocks\.(\d+)\.post_attn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blocks\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^blocks\.(\d+)\.ffn\.router\.", r"model.layers.\1.mlp.gate."),
    (r"^blocks\.(\d+)\.ffn\.shared_expert\.", r"model.layers.\1.mlp.{shared}."),
    (r"^blocks\.(\d+)\.ffn\.", r"model.layers.\1.mlp."),
)


def hf_name(ours: str, family: Family) -> str:
    """Our tensor name -> the family's transformers (in-memory) name, e.g. ``blocks.0.ffn.router.weight`` ->
    ``model.layers.0.mlp.gate.weight``; ``lm_head.weight`` is the same on both sides."""
    for pattern, repl in _RULES:
        new, n = re.subn(pattern, repl, ours)
        if n:
            return new.replace("{shared}", family.shared_name)
    return ours


def layer_index(ours: str) -> int | None:
    """The block index in one of our tensor names, or ``None`` outside the blocks."""
    m = re.match(r"^blocks\.(\d+)\.", ours)
    return int(m.group(1)) if m else None
