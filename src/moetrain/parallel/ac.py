"""Activation checkpointing of transformer blocks, attached from outside the model
(``torch.distributed._composable.checkpoint``: non-reentrant, parameter names unchanged, composes with FSDP2);
the modes and what they cost: docs/scale-out.md, Activation checkpointing.

``selective`` recomputes the attention module (left to BTA when ``bta_tiles > 1``: model/bta.py recomputes its
tiles already) and the routed-experts module, inside which every expert backend runs (the fused one's dispatch +
experts + combine included: moe/experts.py). Random numbers (router jitter) are replayed (``preserve_rng_state``),
so the recompute routes identically. A forward hook of a recomputed module runs again during backward;
:func:`in_recompute` tells such hooks (the routing monitor's) apart from the real forward.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed._composable import checkpoint

from moetrain.errors import ConfigError
from moetrain.model.block import Block

MODES = ("none", "full", "selective")


def in_recompute() -> bool:
    """True while autograd's engine runs (a checkpointed forward being recomputed in backward), False in a normal
    forward. Cost: one C++ call."""
    return torch._C._current_graph_task_id() != -1


def blocks(model: nn.Module) -> list[Block]:
    """The transformer blocks of ``model`` (an ``MoETransformer``'s ``ModuleList``, or a pipeline stage's
    ``ModuleDict``)."""
    blocks = model.blocks
    modules = blocks.values() if isinstance(blocks, nn.ModuleDict) else cast(nn.ModuleList, blocks)
    return [cast(Block, b) for b in modules]


def apply(model: nn.Module, mode: str) -> list[str]:
    """Attach checkpointing to the blocks of ``model`` (an ``MoETransformer`` or a pipeline stage) in place.

    Args:
        model: has ``blocks`` (``ModuleList`` or ``ModuleDict``).
        mode: ``none``, ``full`` or ``selective``.
    Returns:
        Qualified names of the modules now recomputed in backward.
    Raises:
        ConfigError: an unknown mode (``parallel.activation_checkpoint``).
    """
    if mode not in MODES:
        raise ConfigError(f"parallel.activation_checkpoint: unknown mode {mode!r}; choose one of {list(MODES)}")
    names = {m: n for n, m in model.named_modules()}
    done = []
    for block in blocks(model):
        targets: list[nn.Module] = []
        if mode == "full":
            targets = [block]
        elif mode == "selective":
            targets = [] if block.bta_tiles > 1 else [block.attn]
            if block.is_moe:
                targets.append(cast(nn.Module, block.ffn.experts))
        for module in targets:
            checkpoint(module, use_reentrant=False, preserve_rng_state=True)
            done.append(names[module])
    return done
