"""int8 weight-only routed experts for the CPU serving path (``moetrain serve --int8-experts``; docs/serving.md).

Legend: E = experts, D = hidden, F = expert FFN hidden, O = a weight's output rows, I = its inputs, R = dispatched
rows.

Each routed expert's ``w_in`` [2F, D] (or GELU ``up_proj`` [F, D]) and ``down_proj`` [D, F] are stored as int8 with
one fp32 scale per output row: ``scale[o] = max_i |w[o, i]| / 127``, ``q = round(w / scale)`` (symmetric, in
[-127, 127]; an all-zero row gets scale 1). Memory: about 0.26 of fp32.

Dequantise on use: these weights are the layer's weight provider; its per-expert loop
(:func:`moetrain.moe.experts.expert_loop`) converts one expert's int8 values at a time to the layer's dtype and
applies the scale to the matmul's output columns (``(x @ q^T) * scale``, the product ``x @ (q * scale)^T`` without a
pass over the weight). No int8 GEMM: it saves memory, not time. Shared experts and dense FFNs stay as they are.
Quality: :func:`moetrain.serve.quality.int8_experts_report`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moetrain.errors import MoetrainError
from moetrain.moe.experts import expert_loop


@dataclass(frozen=True)
class Int8Weight:
    """One [E, O, I] expert weight as int8 ``q`` [E, O, I] and fp32 ``scale`` [E, O] (per output row)."""

    q: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def quantize(w: torch.Tensor) -> Int8Weight:
        """Symmetric per-output-row int8 of ``w`` [E, O, I] (any float dtype; computed in fp32)."""
        w32 = w.detach().float()
        amax = w32.abs().amax(dim=-1)  # [E, O]
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q = torch.round(w32 / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        return Int8Weight(q, scale)

    def dequantized(self) -> torch.Tensor:
        """[E, O, I] fp32 ``q * scale``."""
        return self.q.float() * self.scale[..., None]

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


class Int8Experts:
    """int8 copies of every MoE layer's routed experts, computed by :meth:`experts_forward` (the layers' expert
    provider, :meth:`moetrain.moe.layer.MoELayer.set_expert_provider`).

    Args:
        model: a :class:`~moetrain.model.transformer.MoETransformer` with its expert weights loaded.
    Raises:
        MoetrainError: the model has no MoE layers.
    """

    def __init__(self, model: Any) -> None:
        blocks = [i for i, b in enumerate(model.blocks) if b.is_moe]
        if not blocks:
            raise MoetrainError("--int8-experts: the model has no MoE layers")
        self.model, self.blocks = model, blocks
        self.activation = model.blocks[blocks[0]].ffn.experts.activation
        self.dtype = model.blocks[blocks[0]].ffn.experts.down_proj.dtype  # the compute dtype
        self.weights: dict[int, tuple[Int8Weight, Int8Weight]] = {}
        self._layer_blocks = {id(model.blocks[b].ffn): b for b in blocks}
        self.fp32_bytes = 0
        for b in blocks:
            ex = model.blocks[b].ffn.experts
            self.weights[b] = (Int8Weight.quantize(ex.w_in), Int8Weight.quantize(ex.down_proj))
            self.fp32_bytes += (ex.w_in.numel() + ex.down_proj.numel()) * 4

    def nbytes(self) -> int:
        """Bytes held: int8 weights and fp32 scales of every layer."""
        return sum(a.nbytes() + b.nbytes() for a, b in self.weights.values())

    def release_fp32(self) -> None:
        """Replace the model's own routed-expert weights by meta tensors (only the int8 copies stay resident); the
        model then runs only through :meth:`experts_forward`."""
        from moetrain.serve.expert_store import release_experts

        release_experts(self.model, self.blocks)

    def experts_forward(self, layer, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The routed experts of ``layer`` from their int8 weights (its
        :data:`~moetrain.moe.layer.ExpertProvider`): rows [R, D] grouped by expert, tokens_per_expert [E] int64 ->
        [R, D] in the model's expert dtype, by the per-expert loop (:func:`~moetrain.moe.experts.expert_loop`) with
        these weights as its :data:`~moetrain.moe.experts.ExpertWeights` (each expert's int8 values and scales)."""
        w_in, w_out = self.weights[self._layer_blocks[id(layer)]]

        def weights(used: list[int]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
            return ((e, w_in.q[e], w_out.q[e], w_in.scale[e], w_out.scale[e]) for e in used)

        return expert_loop(rows, tokens_per_expert, weights, self.activation, self.dtype)
