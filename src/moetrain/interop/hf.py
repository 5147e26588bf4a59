"""Hugging Face checkpoints in and out: :func:`to_hf` writes a directory that ``transformers`` loads with the same
logits; :func:`from_hf` builds our model from such a directory or from an in-memory ``PreTrainedModel``. (The HF
``Trainer`` integration, ``moetrain.hf``, is :mod:`moetrain.interop.hf_trainer`.)

Legend: E = experts, D = hidden, F = expert FFN hidden.

Writing goes through transformers itself: our tensors are renamed to the family's names, assigned to an HF model
built on the meta device (no memory, no init), and saved with ``save_pretrained(max_shard_size=...)``, which
shards, writes ``model.safetensors.index.json`` and converts the experts to the layout the family's hub
checkpoints use. Reading is ours: the safetensors files are opened lazily, every tensor's shape is checked against
the config before it is read, and the expert layout is declared per format (see interop/layouts.py).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetrain.data.tokenizer import EOS_TOKEN
from moetrain.errors import CheckpointError, ConfigError
from moetrain.interop.families import (
    DENSE_FAMILIES,
    FAMILIES,
    REFUSED_TYPES,
    Family,
    family_for,
    fold_routed_scale,
    hf_config_dict,
    hf_name,
    layer_index,
    model_config_from_hf,
)
from moetrain.interop.layouts import FUSED, ExpertLayout, detect_layout
from moetrain.model.config import ModelConfig
from moetrain.model.transformer import MoETransformer
from moetrain.train.checkpoint import model_tensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints saved this non-persistent buffer


def transformers_module() -> Any:
    """``transformers``, or a ConfigError naming the ``hf`` extra when it is missing or older than 5."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("Hugging Face interop needs transformers >= 5: pip install 'moetrain[hf]'") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ConfigError(f"Hugging Face interop needs transformers >= 5 (fused expert modules); found "
                          f"{transformers.__version__}")
    return transformers


# ---- ours -> HF -----------------------------------------------------------------------------------------------

def to_hf_model(model: MoETransformer, tokenizer: Any = None, runnable: bool = False, **hf_kwargs: Any):
    """An in-memory transformers ``*ForCausalLM`` holding ``model``'s weights.

    Args:
        model: our model.
        tokenizer: its ``tokenizers.Tokenizer`` (the config's ``eos_token_id``), or ``None``.
        runnable: ``False``: built on the meta device, the weights shared with ``model`` (no copy on CPU) and the
            non-persistent buffers (RoPE tables) left on the meta device, for ``save_pretrained`` only; ``True``:
            built on the CPU with a copy of the weights, to run and train apart from ``model``.
        hf_kwargs: passed to ``AutoModelForCausalLM.from_config`` (``attn_implementation``, ...).
    Raises:
        ConfigError: a configuration with no faithful HF equivalent (see :func:`family_for`).
    """
    tf = transformers_module()
    family = family_for(model.config)
    kwargs = hf_config_dict(model.config, family)
    # Explicit None: the config classes default to ids (Mixtral: bos 1, eos 2) that would stop generation early.
    kwargs.update(bos_token_id=None, eos_token_id=tokenizer.token_to_id(EOS_TOKEN) if tokenizer is not None else None,
                  pad_token_id=None)
    config = tf.AutoConfig.for_model(family.model_type, **kwargs)
    config.architectures = [family.architecture]
    # Our weights under the family's names (fused experts), tied duplicates dropped; the routed experts' down_proj
    # carry the router's routed_scaling_factor where the family has no such field (a scaled copy, the rest shared).
    tensors = fold_routed_scale(model_tensors(model), model.config, family)
    state = {hf_name(name, family): t for name, t in tensors.items()}
    config.dtype = next(iter(state.values())).dtype
    with torch.device("cpu" if runnable else "meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")  # zero-width shared experts
        hf = tf.AutoModelForCausalLM.from_config(config, **hf_kwargs)
    result = hf.load_state_dict(state, strict=False, assign=not runnable)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if model.config.tie_embeddings else set())
    # What the family always has and we may not: dots.llm1's e_score_correction_bias (zeros = no bias) and its
    # shared experts (zero width = none).
    hf_state = hf.state_dict()
    fill = {k: torch.zeros(hf_state[k].shape, dtype=hf_state[k].dtype) for k in missing
            if k.endswith("e_score_correction_bias") or hf_state[k].numel() == 0}
    hf.load_state_dict(fill, strict=False, assign=True)
    missing -= set(fill)
    if missing or result.unexpected_keys:  # a bug in the name mapping, not a user error
        raise RuntimeError(f"HF name mapping incomplete: missing {sorted(missing)[:3]}, unexpected "
                           f"{sorted(result.unexpected_keys)[:3]}")
    if model.config.tie_embeddings:
        hf.tie_weights()
    return hf


def to_hf(model: MoETransformer, out_dir: str | Path, tokenizer: Any = None, max_shard_size: str | int = "5GB"
          ) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory.

    Files: ``config.json`` (the family picked by :func:`~moetrain.interop.families.family_for`), the weights as
    ``model.safetensors`` or, above ``max_shard_size``, ``model-0000i-of-0000n.safetensors`` shards with
    ``model.safetensors.index.json`` (transformers' ``save_pretrained``), ``generation_config.json`` and, with a
    ``tokenizer``, ``tokenizer.json`` + ``tokenizer_config.json`` (our ``tokenizers.Tokenizer`` wrapped in
    ``PreTrainedTokenizerFast``, EOS = ``<|endoftext|>``).

    Args:
        model: our model (any device; weights are saved in their dtype).
        out_dir: created if missing.
        tokenizer: a ``tokenizers.Tokenizer`` (the run's), or ``None``.
        max_shard_size: largest shard, e.g. ``"5GB"`` or bytes.
    Returns:
        ``out_dir``.
    Raises:
        ConfigError: a configuration with no faithful HF equivalent (the message names the feature).
    """
    tf = transformers_module()
    out = Path(out_dir)
    hf = to_hf_model(model, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out, max_shard_size=max_shard_size)
    _readable_as_created(out.glob("*.safetensors"))
    eos = hf.config.eos_token_id
    tf.GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=None).save_pretrained(out)
    if tokenizer is not None:
        fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN,
                                          model_max_length=model.config.max_seq_len)
        fast.save_pretrained(out)
    return out


def _readable_as_created(paths) -> None:
    """Give ``paths`` the mode a plain ``open(path, "w")`` would (``0o666`` less the umask): safetensors writes
    through a ``0600`` temporary file, so another user or service account could not load an export."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


# ---- HF -> ours -----------------------------------------------------------------------------------------------

class TensorSource:
    """Named tensors read on demand, with their shapes checked before reading.

    Args:
        shapes: name -> shape of every tensor available.
        load: name -> tensor.
        where: what to name in errors (a directory or a model class).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], load: Callable[[str], torch.Tensor], where: str):
        self.shapes, self._load, self.where = shapes, load, where
        self.used: set[str] = set()

    def get(self, name: str, expected: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name`` if its shape is ``expected``; raises CheckpointError otherwise (naming both shapes)."""
        if name not in self.shapes:
            raise CheckpointError(f"{self.where}: tensor '{name}' is missing (the config implies it)")
        if tuple(self.shapes[name]) != tuple(expected):
            raise CheckpointError(f"{self.where}: tensor '{name}' has shape {tuple(self.shapes[name])}, but the "
                                  f"config implies {tuple(expected)}")
        self.used.add(name)
        return self._load(name)

    @classmethod
    def from_directory(cls, root: Path) -> TensorSource:
        """Lazily open ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.

        Raises:
            CheckpointError: neither file exists, or the index names a missing shard.
        """
        from safetensors import safe_open

        if (root / INDEX_FILE).is_file():
            weight_map: dict[str, str] = json.loads((root / INDEX_FILE).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (root / WEIGHTS_FILE).is_file():
            files, weight_map = [WEIGHTS_FILE], {}
        else:
            raise CheckpointError(f"{root}: no {WEIGHTS_FILE} or {INDEX_FILE} (only safetensors checkpoints are "
                                  "read; convert others with transformers' save_pretrained)")
        handles, shapes, owner = {}, {}, {}
        for fname in files:
            if not (root / fname).is_file():
                raise CheckpointError(f"{root / INDEX_FILE}: shard '{fname}' is missing")
            h = safe_open(str(root / fname), framework="pt")
            handles[fname] = h
            for key in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shapes[key] = tuple(h.get_slice(key).get_shape())
                owner[key] = fname
        return cls(shapes, lambda name: handles[owner[name]].get_tensor(name), str(root))


def read_hf_config(path: str | Path) -> tuple[Family, Any]:
    """(family, transformers config object) of a checkpoint directory.

    Raises:
        MoetrainError: a missing directory or ``config.json``, an unsupported or unmappable ``model_type``.
    """
    tf = transformers_module()
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory")
    if not (root / CONFIG_FILE).is_file():
        raise CheckpointError(f"{root}: no {CONFIG_FILE}; is this a Hugging Face model directory?")
    try:
        raw = json.loads((root / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{root / CONFIG_FILE}: cannot parse: {e}") from None
    family = family_of(raw.get("model_type"), str(root / CONFIG_FILE))
    return family, tf.AutoConfig.from_pretrained(str(root))


def family_of(model_type: Any, where: str) -> Family:
    """The supported family of a ``model_type``.

    Raises:
        ConfigError: unsupported, or recognised but with a feature that does not map.
    """
    if model_type in REFUSED_TYPES:
        raise ConfigError(f"{where}: model_type '{model_type}' cannot be imported: {REFUSED_TYPES[model_type]}")
    known = {**FAMILIES, **DENSE_FAMILIES}
    if model_type not in known:
        raise ConfigError(f"{where}: unsupported model_type {model_type!r}; supported: MoE {sorted(FAMILIES)}, "
                          f"dense (for upcycling) {sorted(DENSE_FAMILIES)}")
    return known[model_type]


def _read_layer_experts(src: TensorSource, family: Family, cfg: ModelConfig, i: int, layouts: tuple[ExpertLayout, ...]
                        ) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(gate_up_proj [E, 2F, D], down_proj [E, D, F], the MoE block's HF prefix) of block ``i``."""
    prefixes = [f"model.layers.{i}.mlp"]
    if family.legacy_moe_name:
        prefixes.append(f"model.layers.{i}.{family.legacy_moe_name}")
    for block in prefixes:
        layout = detect_layout(src.shapes, f"{block}.experts", layouts)
        if layout is not None:
            m = cfg.moe
            gate_up, down = layout.read(src.get, f"{block}.experts", m.num_experts, cfg.hidden, m.experts.ffn_hidden)
            return gate_up, down, block
    looked = ", ".join(f"'{p}.experts.{layout.probe}'" for p in prefixes for layout in layouts)
    raise CheckpointError(f"{src.where}: no experts for layer {i}: looked for {looked}")


def load_tensors(src: TensorSource, family: Family, cfg: ModelConfig, layouts: tuple[ExpertLayout, ...]
                 ) -> dict[str, torch.Tensor]:
    """Our state dict for ``cfg`` read from ``src`` (HF names of ``family``), every shape checked.

    Raises:
        CheckpointError: a missing tensor, a shape that disagrees with the config (both shapes named), or a tensor
            the config does not account for.
    """
    out: dict[str, torch.Tensor] = {}
    moe_block: dict[int, str] = {}
    with torch.device("meta"):  # our names and shapes for cfg, without memory
        expected = {name: tuple(t.shape) for name, t in MoETransformer(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        del expected["lm_head.weight"]  # the tied copy of embed_tokens.weight
    for name, shape in expected.items():
        i = layer_index(name)
        if name.endswith("ffn.experts.gate_up_proj"):
            assert i is not None  # expert tensors are in blocks (blocks.{i}.ffn.experts.*)
            gate_up, down, moe_block[i] = _read_layer_experts(src, family, cfg, i, layouts)
            out[name], out[name.replace("gate_up_proj", "down_proj")] = gate_up, down
    for name, shape in expected.items():
        if name in out:
            continue
        hf = hf_name(name, family)
        i = layer_index(name)
        if i in moe_block and hf.startswith(f"model.layers.{i}.mlp."):
            hf = moe_block[i] + hf[len(f"model.layers.{i}.mlp"):]
        out[name] = src.get(hf, shape)
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    for k in sorted(set(src.shapes) - src.used):
        # dots.llm1 stores e_score_correction_bias even for a model without an expert bias: all zeros, no effect.
        if (k.endswith(".mlp.gate.e_score_correction_bias") and not cfg.moe.router.expert_bias
                and bool(src.get(k, src.shapes[k]).any())):
            raise CheckpointError(f"{src.where}: tensor '{k}' is non-zero, but config.json's moetrain.expert_bias "
                                  "is false")
    ignored |= {k for k, shape in src.shapes.items() if 0 in shape}  # e.g. zero-width shared experts: nothing
    extra = sorted(k for k in set(src.shapes) - src.used - ignored if not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise CheckpointError(f"{src.where}: unexpected tensor '{extra[0]}' (the config does not account for it"
                              f"{f'; {len(extra) - 1} more' if len(extra) > 1 else ''})")
    return out


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> MoETransformer:
    """Our model holding ``tensors`` (cast to ``dtype`` unless ``None``), without a random initialisation."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    if cfg.tie_embeddings:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"from_hf: {left[0]} was not loaded")
    return model


def from_hf(path_or_model: Any, dtype: torch.dtype | None = torch.float32) -> MoETransformer:
    """Our model from a Hugging Face checkpoint directory or an in-memory transformers ``PreTrainedModel``.

    Families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, dots.llm1 (DeepSeek-V3 router: sigmoid scores, groups, expert
    bias, shared experts, with grouped-query attention); and the dense Llama, Mistral (no sliding window), Qwen2
    and Qwen3, which load as dense models (``moe_every=0``, the input of :mod:`moetrain.interop.upcycle`). Expert
    layouts are declared per format: a directory may hold fused ``gate_up_proj`` [E, 2F, D] (gate first), per-expert
    ``gate_proj/up_proj/down_proj``, or Mixtral's ``w1/w3/w2``; an in-memory model always has the fused layout.

    Args:
        path_or_model: a directory with ``config.json`` and safetensors weights, or a ``PreTrainedModel``.
        dtype: weights are cast to it (fp32 by default: training keeps fp32 master weights); ``None`` keeps theirs.
    Returns:
        The model in train mode, on the CPU (or the in-memory model's device).
    Raises:
        CheckpointError: no such directory, no ``config.json``, no weights, a tensor whose shape disagrees with the
            config (named, with both shapes), a missing or unexpected tensor.
        ConfigError: an unsupported ``model_type``, or a config feature with no faithful equivalent here.
    """
    tf = transformers_module()
    if isinstance(path_or_model, tf.PreTrainedModel):
        hf_cfg, where, state = path_or_model.config, type(path_or_model).__name__, path_or_model.state_dict()
        family = family_of(getattr(hf_cfg, "model_type", None), where)
        src = TensorSource({k: tuple(v.shape) for k, v in state.items()}, state.__getitem__, where)
        layouts: tuple[ExpertLayout, ...] = (FUSED,)
    else:
        family, hf_cfg = read_hf_config(path_or_model)
        src = TensorSource.from_directory(Path(path_or_model))
        layouts = family.disk_layouts
    cfg = model_config_from_hf(hf_cfg, family)
    tensors = fold_routed_scale(load_tensors(src, family, cfg, layouts), cfg, family, inverse=True)
    return build_model(cfg, tensors, dtype)
