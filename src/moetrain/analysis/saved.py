"""Measured activation memory: the bytes autograd saves for backward, counted with ``saved_tensors_hooks``.

The measurement the cost model (:mod:`.activations`) is checked against. A tensor counts once per distinct
storage (``q_proj``, ``k_proj`` and ``v_proj`` all save the same normed input; ``chunk`` views share one buffer) and
with its whole storage's bytes; parameter storages are excluded (weights are not activations).

Tensors saved inside a non-reentrant ``torch.utils.checkpoint`` region never reach these hooks (the checkpoint's own
hooks are innermost and keep only a placeholder); what such a region keeps alive is the input it closes over, which
:func:`saved_bytes_per_block` adds for BTA blocks, and one region's activations during its recomputation in
backward, which :func:`tile_attention_bytes` measures by running the region's function directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, cast

import torch

if TYPE_CHECKING:
    from moetrain.model.block import Block
    from moetrain.model.transformer import MoETransformer


def _key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


class SavedTensorCounter:
    """Context manager: counts the distinct storages autograd saves inside it, in bytes, into named buckets.

    Args:
        exclude: tensors (usually ``model.parameters()``) whose storages are not counted.

    Attributes:
        buckets: bucket name -> bytes saved while that bucket was current (see :meth:`use`).

    Saved tensors are also referenced here until the counter is dropped, so a freed buffer cannot be reused under
    the same address and be mistaken for one already counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {_key(t) for t in exclude}
        self._seen: set[tuple[str, int]] = set()
        self._keep: list[torch.Tensor] = []
        self.buckets: dict[str, int] = {}
        self.current = "other"
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def use(self, bucket: str) -> None:
        """Attribute what is saved from now on to ``bucket``."""
        self.current = bucket

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage in the current bucket unless it was already counted (or is excluded)."""
        key = _key(t)
        if key in self._exclude or key in self._seen:
            return
        self._seen.add(key)
        self._keep.append(t)
        self.buckets[self.current] = self.buckets.get(self.current, 0) + t.untyped_storage().nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @property
    def total(self) -> int:
        """Bytes over all buckets."""
        return sum(self.buckets.values())

    def __enter__(self) -> "SavedTensorCounter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


@dataclass
class SavedBytes:
    """Saved-for-backward bytes of one forward pass of an :class:`~moetrain.model.transformer.MoETransformer`.

    Attributes:
        blocks: bytes per block, in block order (BTA blocks include the input their checkpoints hold).
        attention: the part of ``blocks`` saved by the input norm and the attention (with the block input).
        other: bytes outside the blocks (embedding, final norm, LM head, loss).
        tile_recompute: the largest bytes one attention tile holds while it is recomputed in backward (0 without
            BTA); only one tile in the whole model is alive at a time, so it adds once to the peak.
    """

    blocks: list[int] = field(default_factory=list)
    attention: list[int] = field(default_factory=list)
    other: int = 0
    tile_recompute: int = 0

    @property
    def peak(self) -> int:
        """Bytes alive for backward at its start: everything saved plus one tile's recomputation."""
        return sum(self.blocks) + self.other + self.tile_recompute


def saved_bytes_per_block(model: MoETransformer, input_ids: torch.Tensor, targets: torch.Tensor,
                          return_logits: bool = True) -> SavedBytes:
    """Run one training forward of ``model`` (an MoETransformer) on [B, S] int64 ids and targets and count the bytes
    saved for backward, per block. Backward is not run; the graph is freed on return. ``return_logits=False``
    runs the fused LM head + loss, as the trainer does.

    Returns:
        :class:`SavedBytes`.
    """
    counter = SavedTensorCounter(exclude=model.parameters())
    tile_inputs: list[tuple[Block, torch.Tensor]] = []
    blocks = cast("Sequence[Block]", model.blocks)  # the model's nn.ModuleList of Blocks

    def enter(i):
        def hook(block, args):
            counter.use(f"block{i}.attn")
            if getattr(block, "bta_tiles", 1) > 1 and torch.is_grad_enabled():
                # The tiles' checkpoints close over views of the block input: it stays alive for backward.
                counter.add(args[0])
                tile_inputs.append((block, args[0]))
        return hook

    def ffn(i):
        return lambda module, args: counter.use(f"block{i}.ffn")

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(enter(i)))
        handles.append(block.post_attn_norm.register_forward_pre_hook(ffn(i)))
        handles.append(block.register_forward_hook(lambda *_: counter.use("other")))
    try:
        with counter:
            out = model(input_ids, targets, return_logits=return_logits)
    finally:
        for h in handles:
            h.remove()
    del out
    n = len(blocks)
    attention = [counter.buckets.get(f"block{i}.attn", 0) for i in range(n)]
    result = SavedBytes(
        blocks=[attention[i] + counter.buckets.get(f"block{i}.ffn", 0) for i in range(n)],
        attention=attention,
        other=counter.buckets.get("other", 0),
    )
    for block, x in tile_inputs:
        tile = x[: x.shape[0] // block.bta_tiles].detach().clone().requires_grad_(x.requires_grad)
        result.tile_recompute = max(result.tile_recompute, tile_attention_bytes(block, tile, model.parameters()))
    return result


def tile_attention_bytes(block: Block, tile: torch.Tensor, params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes saved for backward by one block's attention branch (``block.attend``) on ``tile`` [b, S, D]: what a
    BTA tile holds while it is recomputed, or the untiled attention's share when ``tile`` is the whole batch.

    ``tile`` itself is not counted (its holder, the block input, is counted with the block); ``params`` are
    excluded like weights."""
    counter = SavedTensorCounter(exclude=[*params, tile])
    with torch.enable_grad(), counter:
        out = block.attend(tile)
    del out
    return counter.total
