"""Per-slot KV caches for continuous batching: one pre-allocated block of ``max_seq_len`` positions per slot.

Legend: N = slots, L = layers, Hkv = key/value heads, P = positions (max_seq_len), Hd = head size.

Why pre-allocated blocks and not a paged layout (vLLM's PagedAttention): a slot holds one sequence of at most the
model's context (128 positions for ``tiny``, 1024 for ``cpu-small``), so the worst-case waste of a whole block is
small (cpu-small fp32: 2 x 4 layers x 2 heads x 1024 x 32 x 4 B = 2 MiB per slot) and known at start-up; pages
would save memory only for many long-context slots, and they need an attention kernel that reads keys through a
block table, which ``F.scaled_dot_product_attention`` does not have (a gather per step would cost what paging
saves). Blocks give contiguous [Hkv, P, Hd] keys per slot that SDPA reads directly, and admission cannot fail
half-way for lack of pages: a free slot is all a request needs.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """Keys and values of ``num_slots`` sequences, each in its own fixed block.

    Attributes:
        k, v: per layer, [N, Hkv, P, Hd] tensors (zeros at start; a slot's positions past its length are stale and
            always masked).
    """

    def __init__(self, num_slots: int, n_layers: int, n_kv_heads: int, max_len: int, head_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_slots, n_kv_heads, max_len, head_size)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.num_slots, self.max_len = num_slots, max_len

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None:
        """Store k, v [T, Hkv, Hd] of T tokens at (``slots`` [T], ``positions`` [T]) of ``layer``."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def nbytes(self) -> int:
        """Bytes held by all blocks."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
