"""Configuration of the decoder-only MoE language model (Mixtral / Qwen3-MoE / OLMoE family)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moetrain.configlib import require, require_at_least
from moetrain.execution import ExecutionConfig
from moetrain.moe.config import MoEConfig


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The transformer.

    Fields:
        vocab_size: tokens in the vocabulary (the tokenizer is trained to this size).
        hidden: model width D.
        n_layers: transformer blocks L.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention; n_heads % n_kv_heads == 0).
        head_dim: per-head width; ``None`` means hidden // n_heads (then hidden must divide by n_heads).
        ffn_hidden: hidden width of the dense SwiGLU FFN used by non-MoE blocks.
        qk_norm: RMSNorm of queries and keys before attention: ``none``; ``head`` over each head's q and k
            (Qwen3); ``full`` over the whole q and k projections (OLMoE).
        attention_bias: add a bias to the q, k and v projections (not o): Qwen2 / Qwen2-MoE's ``qkv_bias``.
        tie_embeddings: share the embedding and LM-head weights.
        rope_theta: rotary embedding base.
        max_seq_len: longest sequence (prompt + generated tokens) the model is used with.
        norm_eps: epsilon of the norms (RMSNorm or LayerNorm).
        norm: the block and final norms: ``rmsnorm`` (Mixtral, Qwen, OLMoE) or ``layernorm`` (mean-centred, with a
            bias; model/norm.py says why; not exportable to the HF MoE families). q/k norms stay RMSNorm.
        moe_every: every N-th block is MoE (block i is MoE when (i + 1) % N == 0, as Qwen2-MoE's
            ``decoder_sparse_step``); 0 makes every block dense.
        first_k_dense: the first K blocks are dense regardless of ``moe_every`` (DeepSeek's ``first_k_dense_replace``).
        init_std: standard deviation of the normal weight initialisation.
        dropout: probability of zeroing an element of the token embeddings and of each block's attention and FFN
            (dense or MoE) outputs before their residual add, in training only (GPT-2's ``embd_pdrop`` /
            ``resid_pdrop``, nanoGPT's ``dropout``; Switch Transformer trains with 0.1). 0 = off.
        moe: the MoE layer (:class:`~moetrain.moe.config.MoEConfig`).
        execution: how the model runs (:class:`~moetrain.execution.ExecutionConfig`: the MoE backend, recomputed
            experts, BTA tiles); it changes no maths, so a resumed run may change it.
    """

    vocab_size: int = 8192
    hidden: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int | None = None
    ffn_hidden: int = 1024
    qk_norm: Literal["none", "head", "full"] = "none"
    attention_bias: bool = False
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    max_seq_len: int = 1024
    norm_eps: float = 1e-6
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    moe_every: int = 1
    first_k_dense: int = 0
    init_std: float = 0.02
    dropout: float = 0.0
    moe: MoEConfig = field(default_factory=MoEConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)

    def __post_init__(self) -> None:
        require_at_least(self, 1, "vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                         "max_seq_len")
        if self.head_dim is None:
            require(self.hidden % self.n_heads == 0, "hidden",
                    f"hidden size {self.hidden} is not divisible by the number of heads n_heads={self.n_heads}")
        else:
            require_at_least(self, 1, "head_dim")
        require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        require(self.head_size % 2 == 0, "head_dim", f"rotary embeddings need an even head size, got {self.head_size}")
        require_at_least(self, 0, "moe_every", "first_k_dense")
        require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        require(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")

    @property
    def head_size(self) -> int:
        """Per-head width: ``head_dim`` or hidden // n_heads."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.n_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE FFN under the layer plan."""
        return is_moe_block(index, self.moe_every, self.first_k_dense)

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]


def is_moe_block(index: int, moe_every: int, first_k_dense: int) -> bool:
    """Whether block ``index`` (0-based) has an MoE FFN: every ``moe_every``-th block (none for 0) after the first
    ``first_k_dense`` (:class:`ModelConfig`'s fields of those names)."""
    if moe_every == 0 or index < first_k_dense:
        return False
    return (index + 1) % moe_every == 0
