"""Shared expert: a dense FFN every token passes through beside the routed experts (DeepSeekMoE, Dai et al., 2024;
Qwen2-MoE), optionally scaled by a per-token sigmoid gate (Qwen2-MoE's ``shared_expert_gate``).

Legend: T = tokens, D = hidden, F = shared expert FFN hidden.

Names follow transformers' ``Qwen2MoeMLP`` (``gate_proj``, ``up_proj``, ``down_proj`` as ``nn.Linear`` without
bias); DeepSeek-V3's ``shared_experts`` (``n_shared_experts`` of width ``moe_intermediate_size``) is one such FFN of
width ``n_shared_experts * moe_intermediate_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SharedExpert(nn.Module):
    """``down(silu(gate x) * up x)`` (``swiglu``) or ``down(gelu(up x))`` (``gelu``); x: [..., D] -> [..., D].

    Args:
        hidden: D.  ffn_hidden: F.
        activation: ``swiglu`` or ``gelu`` (the routed experts' activation).
    """

    def __init__(self, hidden: int, ffn_hidden: int, activation: str = "swiglu"):
        super().__init__()
        self.activation = activation
        if activation == "swiglu":
            self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.silu(self.gate_proj(x)) * self.up_proj(x) if self.activation == "swiglu" else F.gelu(self.up_proj(x))
        y: torch.Tensor = self.down_proj(a)  # [..., D]
        return y


def shared_output(expert: nn.Module, gate: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """The shared expert's output for tokens ``x`` [T, D]: ``expert(x)`` [T, D], times ``sigmoid(gate(x))`` [T, 1]
    when gated (Qwen2-MoE's ``shared_expert_gate``). ``expert`` may be a :class:`SharedExpert` or a transformers
    block's own shared MLP (``interop/hf_trainer.py``)."""
    y: torch.Tensor = expert(x)
    return y if gate is None else torch.sigmoid(gate(x)) * y
