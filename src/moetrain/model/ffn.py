"""Dense SwiGLU feed-forward network (Shazeer, 2020), the FFN of non-MoE blocks: the shared expert's module
(moe/shared_expert.py) with its SwiGLU activation. Names follow transformers' Llama MLP (``gate_proj``, ``up_proj``,
``down_proj``)."""

from __future__ import annotations

from moetrain.moe.shared_expert import SharedExpert


class SwiGLU(SharedExpert):
    """``down(silu(gate(x)) * up(x))``; x: [..., D] -> [..., D]."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__(hidden, ffn_hidden, "swiglu")
