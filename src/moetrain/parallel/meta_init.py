"""Build on the meta device, then materialise only this rank's shards with values that depend on global indices
only, so every layout starts from the same weights without any rank holding the whole model (STYLE.md #6;
docs/scale-out.md, Meta-device build; torchtitan builds on meta and calls ``to_empty`` + ``init_weights`` alike).

Legend: N = rows of a parameter (dim 0: experts for [E, ...] expert tensors, output features for matrices).

Block k of rows of parameter ``name`` (one expert of a 3-D expert tensor, whose shard on dim 1 keeps its columns;
:data:`BLOCK_ROWS` rows of a matrix; a whole vector) is drawn from its own generator seeded with a hash of
(``train.seed``, ``name``, k), so a rank holding rows [a, b) draws only the blocks overlapping them. Distribution
per parameter as ``MoETransformer.reset_parameters``: Normal(0, init_std) for matrices and expert tensors,
``init_std / sqrt(2 * n_layers)`` for output projections, 1 for norm weights, 0 for biases; buffers (the router's
expert bias) start at 0. A bare ``MoETransformer(config)``, one global RNG stream, draws other values.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.model.config import ModelConfig
from moetrain.parallel.layout import ExpertShard

BLOCK_ROWS = 256  # rows of a matrix per generator: a shard wastes < 2 blocks; smaller blocks cost more reseeds


def build_meta(config: ModelConfig) -> nn.Module:
    """The model with every parameter and buffer on the meta device (no memory; shapes and names only)."""
    from moetrain.model.transformer import MoETransformer

    with torch.device("meta"):
        return MoETransformer(config)


def _std(name: str, p: torch.Tensor, config: ModelConfig) -> float | None:
    """Normal std of parameter ``name``; ``None`` for a constant (bias 0, norm weight 1)."""
    if name.endswith(".bias") or p.dim() == 1:
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
        return config.init_std / math.sqrt(2 * config.n_layers)
    return config.init_std


def saved_name(config: ModelConfig, name: str) -> str:
    """The name under which parameter ``name`` is initialised and its optimizer state saved: with tied embeddings
    a pipeline's last stage holds its own copy of the embedding as ``lm_head.weight`` (the first stage holds
    ``embed_tokens.weight``), drawn and saved as the embedding (a tied whole model never names ``lm_head.weight``:
    ``named_parameters`` lists a shared parameter once)."""
    return "embed_tokens.weight" if config.tie_embeddings and name == "lm_head.weight" else name


def _seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def normal_rows(seed: int, name: str, shape: torch.Size, start: int, stop: int, std: float) -> torch.Tensor:
    """Rows ``[start, stop)`` of the parameter ``name`` of global ``shape``: float32 [stop - start, *shape[1:]].

    Raises:
        ValueError: rows outside ``[0, shape[0]]``.
    """
    if not 0 <= start <= stop <= shape[0]:
        raise ValueError(f"{name}: rows [{start}, {stop}) outside the {shape[0]} rows of {tuple(shape)}")
    per = 1 if len(shape) >= 3 else BLOCK_ROWS if len(shape) == 2 else shape[0]
    rest = tuple(shape[1:])
    pieces = []
    for k in range(start // per, -(-stop // per) if stop > start else start // per):
        lo, hi = k * per, min((k + 1) * per, shape[0])
        gen = torch.Generator().manual_seed(_seed(seed, name, k))
        block = torch.empty((hi - lo, *rest)).normal_(0.0, std, generator=gen)
        pieces.append(block[max(start, lo) - lo: min(stop, hi) - lo])
    return torch.cat(pieces) if pieces else torch.empty((0, *rest))


def _offsets(p: torch.Tensor) -> tuple[int, ...]:
    """The offset of ``p``'s local block in each dim: a DTensor's FSDP shard, or zeros for a plain tensor."""
    if not isinstance(p, DTensor):
        return (0,) * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1])


@torch.no_grad()
def init_parameters(model: nn.Module, config: ModelConfig, seed: int,
                    plan: dict[str, ExpertShard] | None = None) -> None:
    """Initialise every parameter's local values (plain, expert slice, FSDP shard or both) and zero the buffers.

    Args:
        model: an ``MoETransformer`` or a pipeline stage with the same parameter names, materialised
            (``to_empty``) or plain.
        config: the model config (``init_std``, ``n_layers``).
        seed: ``train.seed``.
        plan: expert slices ``{name: ExpertShard}`` of expert parallelism (rows offset by the slice's start).
    """
    plan = plan or {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        std = _std(name, p, config)
        if std is None:
            local.fill_(0.0 if name.endswith(".bias") else 1.0)
            continue
        offset, shard = _offsets(p), plan.get(name)  # p.shape: the global shape over FSDP
        start = offset[0] + (shard.offset if shard is not None else 0)
        shape = p.shape if shard is None else shard.global_shape(p.shape)
        rows = normal_rows(seed, saved_name(config, name), shape, start, start + local.shape[0], std)
        if local.dim() > 1 and local.shape[1] != shape[1]:  # sharded on dim 1 too (experts: FSDP2 Shard(1))
            rows = rows[:, offset[1]: offset[1] + local.shape[1]]
        local.copy_(rows)
    for b in model.buffers():
        (b.to_local() if isinstance(b, DTensor) else b).zero_()


def materialise(model: nn.Module, config: ModelConfig, device: torch.device, seed: int,
                plan: dict[str, ExpertShard] | None = None) -> nn.Module:
    """Allocate this rank's shards of a meta-device ``model`` on ``device`` (``to_empty``) and initialise them
    (:func:`init_parameters`). Returns ``model``."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # a tied weight (the LM head's): every (module, name)
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, pname))
    model.to_empty(device=device)
    # to_empty gives each owner its own new tensor; FSDP2 re-ties its DTensor parameters itself (at lazy init)
    for tied in (o for o in owners.values() if len(o) > 1):
        first = getattr(tied[0][0], tied[0][1])
        if not isinstance(first, DTensor):
            for module, pname in tied[1:]:
                setattr(module, pname, first)
    init_parameters(model, config, seed, plan)
    return model
