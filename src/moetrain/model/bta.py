"""Batch Tiling on Attention (BTA): attention over small tiles of the batch, the MoE layer over the whole batch.

Legend: B = micro-batch (sequences), G = tiles, S = sequence, D = hidden.

Why: a sparse MoE layer gives each expert only ``B * S * K / E`` tokens, so its GEMMs starve (low arithmetic
intensity) unless the batch is large; a large batch in turn multiplies the attention activations. BTA decouples the
two: the norm + attention of a block run over G tiles of B / G sequences, one after another, each tile recomputed in
backward (``torch.utils.checkpoint``, non-reentrant), so only one tile's attention activations are alive at a time;
the outputs are concatenated and the FFN / MoE layer runs once over all B * S tokens.

Source: "Batch Tiling on Attention: Efficient Mixture of Experts Training on Wafer-Scale Processors" (Cerebras,
SC'25 workshop), and the Cerebras Model Zoo option ``ws_opt_enable_bta`` / ``ws_opt_bta_max_tile``.

Attention is per-sequence (causal, no cross-sequence terms), so tiling the batch changes no value: outputs and
gradients equal the untiled block's up to float summation order. The cost is one extra forward of each tile's
norm + attention in backward (about a third more attention FLOPs).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from moetrain.errors import ConfigError


def tiled_attention(fn: Callable[..., torch.Tensor], x: torch.Tensor, tiles: int,
                    per_sequence: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` applied to G tiles of ``x`` along the batch, concatenated: equal to ``fn(x)`` for per-sequence ``fn``.

    Args:
        fn: [b, S, D] -> [b, S, D], per-sequence (norm + attention of one block); called as
            ``fn(x_tile, per_sequence_tile)`` when ``per_sequence`` is given.
        x: [B, S, D] block input.
        tiles: G, a divisor of B.
        per_sequence: [B, ...] tensor tiled along with ``x`` (packed documents' ``document_ids`` [B, S]), or
            ``None``.
    Returns:
        [B, S, D]. Each tile is checkpointed: its forward keeps no activations (only a reference to its input
        tile, a view of ``x``) and is recomputed when backward reaches it. Without autograd recording
        (``torch.no_grad``, evaluation, generation) this is plain ``fn(x)``: there is nothing to save.
    Raises:
        ConfigError: G does not divide B (checked only while autograd records).
    """
    if tiles == 1 or not torch.is_grad_enabled():
        # Without autograd nothing is saved for backward, so tiling would only add kernel launches (and an
        # evaluation batch shorter than the micro-batch need not divide by G).
        return fn(x) if per_sequence is None else fn(x, per_sequence)
    batch = x.shape[0]
    if tiles < 1 or batch % tiles != 0:
        raise ConfigError(f"model.execution.bta_tiles: {tiles} attention tiles do not divide the micro-batch of "
                          f"{batch} sequences (train.batch_size={batch}); choose a divisor of it")
    outs = []
    extras = [()] * tiles if per_sequence is None else [(p,) for p in per_sequence.chunk(tiles, dim=0)]
    for tile, extra in zip(x.chunk(tiles, dim=0), extras):  # [B / G, S, D] views, no copy
        # preserve_rng_state=True costs one RNG-state read per tile and keeps any future attention dropout exact.
        outs.append(checkpoint(fn, tile, *extra, use_reentrant=False))
    return torch.cat(outs, dim=0)
