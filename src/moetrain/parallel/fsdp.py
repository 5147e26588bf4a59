"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on the MoE transformer, composed with expert parallelism the way
torchtitan does it (``torchtitan/distributed/fsdp.py: apply_fsdp_to_decoder``; mesh in :mod:`.layout`), and
``replicate`` for plain data parallelism; the units, their meshes and the reasons for them are in docs/scale-out.md
(FSDP2).

Legend: E = experts, X = ep, S = dp_shard, R = dp_replicate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moetrain.errors import ConfigError
from moetrain.model.config import ModelConfig
from moetrain.moe.layer import MoELayer
from moetrain.parallel.ac import blocks as stage_blocks
from moetrain.parallel.comm import named_collective
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.layout import ExpertShard, LayoutMesh
from moetrain.parallel.meta_init import materialise


PlacementFn = Callable[[nn.Parameter], Shard | None]


def mixed_precision(dtype: str) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(policy of every unit, policy of the router) for ``train.dtype``: bf16 compute with fp32 reduction and fp32
    master weights, the router all fp32 (a bf16 gate would change which experts are chosen); fp32: no casts."""
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False), fp32
    return MixedPrecisionPolicy(), MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, mesh: LayoutMesh, parallel: ParallelConfig, dtype: str = "fp32", seed: int = 0,
               plan: dict[str, ExpertShard] | None = None) -> nn.Module:
    """Shard ``model`` (an ``MoETransformer`` or a pipeline stage of one, experts already sliced for EP) in place,
    materialise this rank's shards of a meta-device model (:func:`~.meta_init.materialise`) and fix FSDP2's root.

    Args:
        model: has ``blocks`` (a ``ModuleList`` or ``ModuleDict``), and optionally ``embed_tokens``, ``norm``,
            ``lm_head`` (a pipeline stage may lack them).
        mesh: this rank's :class:`LayoutMesh` (distributed).
        parallel: ``reshard_after_forward`` (ZeRO-3, else ZeRO-2) and ``cpu_offload`` (FSDP2 ``CPUOffloadPolicy``).
        dtype: ``train.dtype`` (``fp32`` or ``bf16``).
        seed: ``train.seed``, for the materialisation.
        plan: the expert slices (:func:`.layout.shard_experts`), for the materialisation.
    Returns:
        ``model``, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.
    Raises:
        ConfigError: ``cpu_offload`` without CUDA (``parallel.cpu_offload``).
    """
    reshard_after_forward, cpu_offload = parallel.reshard_after_forward, parallel.cpu_offload
    if cpu_offload and mesh.device.type != "cuda":
        raise ConfigError("parallel.cpu_offload: FSDP2's CPUOffloadPolicy needs CUDA (it copies host shards to the "
                          "accelerator); on a CPU run the parameters are already in host memory: set it to false")
    policy, router_policy = mixed_precision(dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()

    def shard(module: nn.Module | list[nn.Module], on: DeviceMesh | None, reshard: bool = reshard_after_forward,
              mp: MixedPrecisionPolicy = policy, placement: PlacementFn | None = None) -> None:
        fully_shard(module, mesh=on, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload,
                    shard_placement_fn=placement)

    dense, ep, expert_units = mesh.dense_mesh, mesh.layout.ep, set()
    # One shard per replica (a pipeline stage without sharding; without a pipeline that is apply_replicate):
    # nothing is gathered, so per-block units would only split the gradient all-reduce into many small, slower ones:
    # one unit of every module (its hooks on each, so the routing pre-pass, which skips the root's forward, still
    # finds the weights), the routers apart for their fp32 policy under bf16.
    replicate_only = mesh.layout.dp_shard * ep == 1
    for block in stage_blocks(model):
        placement = None
        if replicate_only:
            if block.is_moe and dtype == "bf16":
                shard(cast(nn.Module, cast(MoELayer, block.ffn).router), dense, reshard=False, mp=router_policy)
            continue
        if block.is_moe:
            layer = cast(MoELayer, block.ffn)
            experts = cast(nn.Module, layer.experts)
            local = next(experts.parameters()).shape[0]  # E / ep
            if ep > 1:
                shard(experts, mesh.expert_mesh, placement=expert_placement(experts, local, mesh.layout.dp_shard))
                # over all R * S * X data-parallel ranks: an expert's gradient already sums its EP group's tokens
                cast(FSDPModule, experts).set_gradient_divide_factor(float(mesh.layout.data_parallel))
                expert_units.add(experts)
            else:
                placement = expert_placement(experts, local, mesh.layout.dp_shard * ep)
            shard(cast(nn.Module, layer.router), dense, mp=router_policy)
        shard(block, dense, placement=placement)
    embed, norm, head = (cast(nn.Module | None, getattr(model, n, None)) for n in ("embed_tokens", "norm", "lm_head"))
    if replicate_only:
        shard([m for m in (embed, *stage_blocks(model), norm, head) if m is not None], dense, reshard=False)
    elif embed is not None and head is not None and head.weight is embed.weight:  # tied: one unit
        shard([m for m in (embed, norm, head) if m is not None], dense)
    else:
        if embed is not None:
            shard(embed, dense)
        tail = [m for m in (norm, head) if m is not None]
        if tail:  # gathered again at once in backward: resharding it after forward would only add an all-gather
            shard(tail, dense, reshard=False)
    shard(model, dense, reshard=False)
    if dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM (a custom divide factor): SUM, then divide locally
        for module in model.modules():
            # Not on an expert unit with one shard (dp_shard = 1): there torch 2.13's foreach_reduce divides by the
            # custom factor when it copies instead of reduce-scattering, then again after (forced sum): gradients
            # came out halved at ep=2. Without forcing, that path divides once and all-reduces replicas with SUM.
            if isinstance(module, FSDPModule) and not (module in expert_units and mesh.layout.dp_shard == 1):
                module.set_force_sum_reduction_for_comms(True)
    if any(p.is_meta for p in model.parameters()):  # built by meta_init.build_meta: this rank's shards only
        materialise(model, cast(ModelConfig, model.config), mesh.device, seed, plan)
    # FSDP2 picks its root at the first forward, but the trainer's first call may be the no-grad routing pre-pass
    # (MoETransformer.moe_counts), which enters the blocks without the root's forward (and FSDP2 refuses meta
    # parameters here).
    cast(FSDPModule, model)._get_fsdp_state()._lazy_init()
    return model


def apply_replicate(model: nn.Module, mesh: LayoutMesh, cpu_offload: bool = False, seed: int = 0,
                    plan: dict[str, ExpertShard] | None = None) -> nn.Module:
    """Plain data parallelism (``dp_shard * ep == 1``, no pipeline): ``torch.distributed._composable.replicate``
    (DDP's reducer on a ``DeviceMesh``; torchtitan's ``apply_ddp``) of ``model`` in place over the ``dp_replicate``
    ranks: whole plain-tensor parameters, gradients averaged in buckets of up to 100 MiB (torchtitan's size) during
    backward, as views into the buckets (docs/scale-out.md, FSDP2).

    No initial broadcast (``init_sync=False``): every rank materialised the same weights from global indices, or
    loads the same checkpoint. No buffer broadcast before each forward (``forward_sync_buffers=False``): the
    buffers are the rotary tables and the expert biases, which every rank updates from the same all-reduced counts.

    Args:
        model: the whole model (an ``MoETransformer``), materialised on ``mesh.device`` here if on the meta device.
        mesh: this rank's :class:`LayoutMesh` (``dp_replicate`` ranks, nothing else).
        cpu_offload: ``parallel.cpu_offload`` (refused: there are no shards to offload).
        seed: ``train.seed``, for the materialisation.
        plan: the expert slices (:func:`.layout.shard_experts`), for the materialisation.
    Returns:
        ``model``, its forward wrapped by the replicate hooks.
    Raises:
        ConfigError: ``cpu_offload`` (``parallel.cpu_offload``).
    """
    from torch.distributed._composable.replicate import replicate

    if cpu_offload:
        raise ConfigError("parallel.cpu_offload: offloads FSDP2 shards, but plain data parallelism (dp_shard=1, "
                          "ep=1) keeps the whole weights on every rank; set it to false")
    assert mesh.replicate_mesh is not None, "apply_replicate on one process"
    if any(p.is_meta for p in model.parameters()):
        materialise(model, cast(ModelConfig, model.config), mesh.device, seed, plan)
    replicate(model, device_mesh=mesh.replicate_mesh, bucket_cap_mb=100, gradient_as_bucket_view=True,
              init_sync=False, forward_sync_buffers=False)
    return model


def expert_placement(experts: nn.Module, local_experts: int, shards: int) -> PlacementFn | None:
    """FSDP2 ``shard_placement_fn`` for expert tensors [E_l, ...]: ``Shard(0)`` (whole experts per rank) when there
    are at least as many local experts as shards, else ``Shard(1)`` (torchtitan's rule: dim-0 sharding of fewer
    experts than ranks would pad every rank to a whole expert); ``None`` (FSDP2's default) for other tensors."""
    if local_experts >= shards:
        return None
    mine = set(experts.parameters())

    def place(p: nn.Parameter) -> Shard | None:
        return Shard(1) if p in mine else None

    return place


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm(model: nn.Module, mesh: LayoutMesh, max_norm: float,
                   counted_elsewhere: nn.Parameter | None = None) -> torch.Tensor:
    """Clip the sharded gradients to ``max_norm`` by their global L2 norm and return it (fp32 scalar), as
    ``torch.nn.utils.clip_grad_norm_`` on one process: coefficient ``max_norm / (norm + 1e-6)`` capped at 1.

    Every rank sums the squares of its local shards; a shard is held by the R replicas, so the sum is divided by R
    before one all-reduce over the whole world (stages hold different parameters, so pipeline stages add up).
    When the world is the R replicas alone (plain data parallelism) every rank holds every gradient, whole and
    already all-reduced: the local sum is the global one, and the step saves a latency-bound collective.
    ``counted_elsewhere`` (the last stage's copy of a tied embedding, whose gradient equals the first stage's) is
    clipped but left out of the sum, so the shared weight counts once, as in one process.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=mesh.device)
    for p in model.parameters():
        if p.grad is not None and p is not counted_elsewhere:
            sq += _local(p.grad).detach().float().pow(2).sum()
    if mesh.distributed and mesh.layout.world > mesh.layout.dp_replicate:
        sq /= mesh.layout.dp_replicate
        with named_collective("all_reduce (squared gradient norm, all ranks)"):
            dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        _local(g).mul_(coef.to(g.dtype))
    return norm


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole (unsharded over FSDP) tensor of ``p``: an all-gather for a DTensor; for checks and exports."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state, from the live local shards.

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes (a tied weight counts once).
    """
    params = {id(p): p for p in model.parameters()}.values()
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for p in params:
        out["params"] += _local(p).numel() * p.element_size()
        if p.grad is not None:
            out["grads"] += _local(p.grad).numel() * p.grad.element_size()
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    out["optimizer"] += _local(v).numel() * v.element_size()
    out["total"] = sum(out.values())
    return out
