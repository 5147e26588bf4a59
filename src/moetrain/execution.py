"""How the model is executed (``model.execution.*``): choices that change neither the function the model computes
nor its weights, only speed and memory. A resumed run may change them (moetrain/train/resume_config.py), e.g. to
fit memory; each is tested equal to its reference (tests/test_moe_backends.py, tests/test_bta.py).

It lives outside ``model/`` and ``moe/`` because both read it: the blocks take ``bta_tiles``, the MoE layer
(:class:`moetrain.moe.layer.MoELayer`) takes the backend and recomputation explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.configlib import require_at_least


@dataclass(frozen=True, kw_only=True)
class ExecutionConfig:
    """Execution choices of the model (``model.execution.*``).

    Fields:
        moe_backend: how the MoE layers run their routed experts. ``fused`` (default: hand-written backward;
            dropless on one device, dispatch + experts + combine run as one autograd Function that saves only
            the pre-activation; per-expert GEMMs on CPU, grouped_mm on CUDA bf16; moe/fast_moe.py), ``grouped_mm``
            (autograd around one grouped GEMM per projection, no host sync), ``padded`` (capacity buffers
            [E, C, D] and batched matmuls; dropless it sizes C to the busiest expert, one host sync) or ``loop``
            (plain per-expert loop, the reference).
        recompute_experts: keep none of the routed experts' intermediate activations for backward; backward
            recomputes them (Megatron-Core's ``--recompute-modules moe`` for the experts). The fused backend reruns
            the input projection block by block in its backward (for SwiGLU 2 of the expert's 3 weight matrices'
            forward FLOPs, i.e. +2/9 of its forward + backward; saves the [T * K, I] pre-activation), the others
            run the experts under ``torch.utils.checkpoint`` (their [T * K, D] dispatched rows stay saved).
            Outputs and gradients are unchanged.
        bta_tiles: Batch Tiling on Attention (BTA, Cerebras): G > 1 runs each block's norm + attention over the
            micro-batch in G tiles of sequences, one after another, each recomputed in backward, and the FFN / MoE
            once over all tokens; G must divide the micro-batch ``train.batch_size``. 1 = off. See model/bta.py.
    """

    moe_backend: Literal["fused", "grouped_mm", "padded", "loop"] = "fused"
    recompute_experts: bool = False
    bta_tiles: int = 1

    def __post_init__(self) -> None:
        require_at_least(self, 1, "bta_tiles", note="1 = no batch tiling")
