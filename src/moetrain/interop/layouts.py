"""Expert weight layouts of checkpoint formats, declared per format and never inferred from tensor shapes.

Legend: E = experts, D = hidden (HF calls it H), F = expert FFN hidden (HF calls it I).

Our layout (and transformers 5's in-memory ``*Experts`` modules): ``gate_up_proj`` [E, 2F, D] with the gate half
first, ``down_proj`` [E, D, F]. Checkpoints on disk use other layouts, and a shape alone cannot tell them apart: with
2F == D, a fused [2F, D] matrix and its transpose have the same shape, and "gate first" vs "up first" is invisible.
So every reader names the layout of the format it reads, and the tensor *names* (which a format fixes) select the
format (:func:`detect_layout`).

Declared layouts:
- ``fused``: ``{p}.gate_up_proj`` [E, 2F, D] (gate rows 0..F-1, up rows F..2F-1) and ``{p}.down_proj`` [E, D, F]
  (transformers 5 ``MixtralExperts`` / ``Qwen3MoeExperts`` in memory).
- ``per_expert``: ``{p}.{e}.gate_proj.weight`` [F, D], ``{p}.{e}.up_proj.weight`` [F, D],
  ``{p}.{e}.down_proj.weight`` [D, F] (Qwen2-MoE, Qwen3-MoE, OLMoE, dots.llm1 hub checkpoints).
- ``w123``: ``{p}.{e}.w1.weight`` = gate [F, D], ``{p}.{e}.w3.weight`` = up [F, D], ``{p}.{e}.w2.weight`` = down
  [D, F] (Mixtral hub checkpoints, ``block_sparse_moe``).
- ``megatron``: ``{p}.{e}.linear_fc1.weight`` [2F, D] (gate rows first: Megatron-Core's SwiGLU ``chunk(2)`` applies
  the activation to the first half) and ``{p}.{e}.linear_fc2.weight`` [D, F] (Megatron-Core ``SequentialMLP``
  ``local_experts``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Getter = Callable[[str, tuple[int, ...]], torch.Tensor]
"""``get(name, expected_shape)`` returns the named tensor, raising CheckpointError when it is missing or its shape
differs (the message names the tensor and both shapes)."""


@dataclass(frozen=True)
class ExpertLayout:
    """How one format stores one layer's E SwiGLU experts under a key prefix ``p``.

    Attributes:
        name: the layout's name (see the module docstring).
        parts: expert e's tensors are ``{p}.{e}.{part}.weight``: (gate, up, down), or (fc1, fc2) with fc1 the gate
            rows then the up rows; empty for ``fused``.
    """

    name: str
    parts: tuple[str, ...] = ()

    @property
    def probe(self) -> str:
        """The name of expert 0's first tensor relative to ``p`` (its presence identifies the layout)."""
        return f"0.{self.parts[0]}.weight" if self.parts else "gate_up_proj"

    def read(self, get: Getter, prefix: str, num_experts: int, hidden: int, ffn: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read one layer's experts into our layout.

        Args:
            get: fetches a tensor by name, checking its shape (see :data:`Getter`).
            prefix: the layer's expert key prefix, e.g. ``model.layers.3.mlp.experts``.
            num_experts: E from the checkpoint's config.
            hidden: D from the checkpoint's config.
            ffn: F from the checkpoint's config.
        Returns:
            (gate_up_proj [E, 2F, D], down_proj [E, D, F]) in the checkpoint's dtype.
        Raises:
            CheckpointError: a missing tensor or a shape that disagrees with the config.
        """
        e, d, f = num_experts, hidden, ffn
        if not self.parts:
            return get(f"{prefix}.gate_up_proj", (e, 2 * f, d)), get(f"{prefix}.down_proj", (e, d, f))
        shapes = [(2 * f, d), (d, f)] if len(self.parts) == 2 else [(f, d), (f, d), (d, f)]
        experts = [[get(f"{prefix}.{i}.{part}.weight", shape) for part, shape in zip(self.parts, shapes)]
                   for i in range(e)]  # [E] lists of (fc1, fc2) or (gate, up, down)
        return torch.stack([torch.cat(w[:-1]) for w in experts]), torch.stack([w[-1] for w in experts])

    def write(self, prefix: str, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> dict[str, torch.Tensor]:
        """Our (gate_up_proj [E, 2F, D], down_proj [E, D, F]) as this layout's named tensors (views, no copies)."""
        if not self.parts:
            return {f"{prefix}.gate_up_proj": gate_up_proj, f"{prefix}.down_proj": down_proj}
        f = down_proj.shape[-1]
        out: dict[str, torch.Tensor] = {}
        for i in range(gate_up_proj.shape[0]):
            fc1 = [gate_up_proj[i]] if len(self.parts) == 2 else [gate_up_proj[i, :f], gate_up_proj[i, f:]]
            out.update({f"{prefix}.{i}.{part}.weight": t for part, t in zip(self.parts, [*fc1, down_proj[i]])})
        return out


FUSED = ExpertLayout("fused")
PER_EXPERT = ExpertLayout("per_expert", ("gate_proj", "up_proj", "down_proj"))
W123 = ExpertLayout("w123", ("w1", "w3", "w2"))
MEGATRON = ExpertLayout("megatron", ("linear_fc1", "linear_fc2"))
LAYOUTS = {layout.name: layout for layout in (FUSED, PER_EXPERT, W123, MEGATRON)}


def detect_layout(keys: Mapping[str, object] | set[str], prefix: str, allowed: tuple[ExpertLayout, ...]
                  ) -> ExpertLayout | None:
    """The layout among ``allowed`` whose probe name exists under ``prefix`` (names decide, never shapes).

    Returns ``None`` when none of them is present (the caller names what it looked for).
    """
    for layout in allowed:
        if f"{prefix}.{layout.probe}" in keys:
            return layout
    return None
