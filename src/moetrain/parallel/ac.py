"""Activation checkpointing of transformer blocks, attached from outside the model
(``torch.distributed._composable.checkpoint``: non-reentrant, parameter names unchanged, composes with FSDP2).

Modes (``parallel.activation_checkpoint``):

- ``full``: each block keeps only its input; its whole forward (attention, router, dispatch, experts, combine) is
  recomputed when backward reaches it: about one more forward per step (+1/3 compute), activations of one block
  alive at a time. With expert parallelism the recompute repeats the block's all-to-alls (as in torchtitan).
- ``selective``: the attention module and the routed-experts module of each block are recomputed; norms, router
  and dispatch metadata are kept. With BTA (``bta_tiles > 1``) attention tiles are already recomputed
  (model/bta.py), so only the experts are added. Every expert backend runs inside the experts module, the fused
  one's dispatch + experts + combine included (moe/experts.py), so this covers them all.

Random numbers (router jitter) are replayed (``preserve_rng_state``), so the recompute routes identically and the
gradients equal those without checkpointing up to summation order.

A forward hook of a recomputed module runs again during backward; :func:`in_recompute` tells such hooks (the
routing monitor's) apart from the real forward.
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
