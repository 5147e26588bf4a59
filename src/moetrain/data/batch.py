"""A micro-batch of packed documents: inputs, targets, padding mask and document ids, with what the loss weights
need (real tokens, real rows).

Legend: b = rows of the micro-batch, s = its row length (<= data.seq_len).

A plain ``(inputs, targets)`` tuple (``data.packing=windows``: every row is one full window, no padding) and a
:class:`PackedBatch` are both accepted by :func:`model_inputs`, the one place that turns a micro-batch into the
arguments of :meth:`moetrain.model.transformer.MoETransformer.forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
PAD_DOCUMENT = -1
"""``document_ids`` value of padding positions."""


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch of whole documents (or chunks of long ones), right-padded.

    Fields:
        inputs: [b, s] int64 token ids; padding positions hold 0 (EOS), never read by the loss.
        targets: [b, s] int64 next-token ids; -100 at padding (no loss).
        padding_mask: [b, s] bool, True for real tokens (the MoE layer's routing statistics, aux losses and
            capacity skip the rest).
        document_ids: [b, s] int64 document index within its row (-1 for padding) when a row holds several
            documents (document-masked attention, model/attention.py); ``None`` when every row holds one document
            starting at position 0, where plain causal attention is already exact (right padding comes after every
            real token, so no real token attends it).
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    padding_mask: torch.Tensor
    document_ids: torch.Tensor | None = None

    @property
    def real_tokens(self) -> int:
        """Tokens that take a loss (``padding_mask.sum()``; a host sync on a device tensor)."""
        return int(self.padding_mask.sum())

    @property
    def real_rows(self) -> int:
        """Rows with at least one real token (the sequences of the sequence-level aux loss)."""
        return int(self.padding_mask.any(dim=1).sum())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedBatch:
        ids = None if self.document_ids is None else fn(self.document_ids)
        return PackedBatch(fn(self.inputs), fn(self.targets), fn(self.padding_mask), ids)

    def to(self, device: torch.device, non_blocking: bool = False) -> PackedBatch:
        """The same batch on ``device`` (``non_blocking`` pays off from pinned memory)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """Page-locked copies (``torch.utils.data.DataLoader(pin_memory=True)`` calls this)."""
        return self._map(torch.Tensor.pin_memory)


Batch = tuple[torch.Tensor, torch.Tensor] | PackedBatch
"""What a batch source yields: ``(inputs, targets)`` [B, S] int64 each (windows) or a :class:`PackedBatch`."""


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    """``batch`` with every tensor on ``device``."""
    if isinstance(batch, PackedBatch):
        return batch.to(device, non_blocking)
    inputs, targets = batch
    return inputs.to(device, non_blocking=non_blocking), targets.to(device, non_blocking=non_blocking)


def model_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """``(inputs, targets, kwargs)`` for ``model(inputs, targets, **kwargs)``: ``padding_mask`` and
    ``document_ids`` for a :class:`PackedBatch`, nothing for a plain tuple."""
    if isinstance(batch, PackedBatch):
        return batch.inputs, batch.targets, {"padding_mask": batch.padding_mask, "document_ids": batch.document_ids}
    inputs, targets = batch
    return inputs, targets, {}


def real_tokens(batch: Batch) -> int:
    """Tokens of ``batch`` that take a loss (all of them for a plain tuple)."""
    return batch.real_tokens if isinstance(batch, PackedBatch) else batch[1].numel()
