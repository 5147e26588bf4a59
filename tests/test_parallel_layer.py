"""Expert parallelism, layer level: an MoE layer whose experts are sharded over EP ranks (gloo, 2 and 4 processes)
gives the same output, loss and gradients (experts, router, input) as one process running the whole batch with the
local dispatcher; the communication counters match the traffic predicted from the routing.

Every rank reads its own slice of a global batch; the reference is the unsharded layer on the whole batch in the
same process. Loss: mean over tokens of <y_t, c_t> plus the router z-loss (both token means, so the global loss is
the mean of the rank losses).

With a capacity, C is a budget per expert per micro-batch of the rank that routes the tokens (the layer drops on
its own tokens before dispatch, as Megatron-Core does from the local tokens), so the single-process reference runs
each rank's slice as its own micro-batch (loss = mean of the slices' losses) and the global batch sees the same
drops.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _parallel_util import ep_mesh, spawn
from moetrain.moe.capacity import capacity_keep, expert_capacity
from moetrain.execution import ExecutionConfig
from moetrain.moe.config import CapacityConfig, ExpertsConfig, MoEConfig
from moetrain.moe.layer import MoELayer
from moetrain.parallel.all_gather import AllGatherDispatcher
from moetrain.parallel.all_to_all import AllToAllDispatcher
from moetrain.parallel.comm import CommStats
from moetrain.parallel.layout import shard_experts

D, F_HIDDEN, T_PER_RANK, K = 8, 16, 6, 2
DISPATCHERS = {"all_to_all": AllToAllDispatcher, "all_gather": AllGatherDispatcher}


def _setup(case: dict, world: int):
    """The full layer, the global batch and the loss weights, identical on every rank (fixed seed)."""
    dtype = torch.float64 if case["dtype"] == "fp64" else torch.float32
    cfg = MoEConfig(num_experts=case["experts"], top_k=K, experts=ExpertsConfig(ffn_hidden=F_HIDDEN),
                    capacity=CapacityConfig(**case.get("capacity", {})))
    torch.manual_seed(1234)
    layer = MoELayer(D, cfg, ExecutionConfig(moe_backend=case["backend"]))
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    x = torch.randn(world * T_PER_RANK, D)
    c = torch.randn(world * T_PER_RANK, D)
    if case.get("idle_last_rank"):
        # Every feature positive and the last EP rank's experts pointing away from them: no token picks them.
        x = x.abs() + 0.2
        per = case["experts"] // case["ep"]
        layer.router.weight.data[-per:] = -1.0
    return layer.to(dtype), x.to(dtype), c.to(dtype)


def _loss(layer: MoELayer, x: torch.Tensor, c: torch.Tensor, autocast: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, aux = layer(x)
    return y, (y.to(c.dtype) * c).sum(-1).mean() + 0.1 * aux.z_loss, aux


def _reference(layer: MoELayer, x: torch.Tensor, c: torch.Tensor, world: int, per_slice: bool, autocast: bool):
    """(y, loss, dropped assignments): the whole batch at once, or (capacity) each rank's slice as a micro-batch."""
    if not per_slice:
        y, loss, aux = _loss(layer, x, c, autocast)
        return y, loss, 0
    ys, loss, dropped = [], 0.0, 0
    for r in range(world):
        rows = slice(r * T_PER_RANK, (r + 1) * T_PER_RANK)
        y, slice_loss, aux = _loss(layer, x[rows], c[rows], autocast)
        ys.append(y)
        loss = loss + slice_loss / world
        dropped += int(aux.dropped_per_expert.sum())
    return torch.cat(ys), loss, dropped


def _kept(layer: MoELayer, x: torch.Tensor, world: int) -> torch.Tensor:
    """[W, T * K] bool: the assignments each rank's slice keeps (all of them when dropless)."""
    cfg = layer.config
    routing = layer.router(x.to(layer.router.weight.dtype))
    ids, weights = routing.topk_ids.reshape(world, T_PER_RANK, K), routing.topk_weights.reshape(world, T_PER_RANK, K)
    if cfg.capacity.factor is None:
        return torch.ones(world, T_PER_RANK * K, dtype=torch.bool)
    cap = expert_capacity(T_PER_RANK, K, cfg.num_experts, cfg.capacity.factor, cfg.capacity.min_capacity)
    return torch.stack([capacity_keep(ids[r], weights[r], cfg.num_experts, cap, cfg.capacity.drop_policy).reshape(-1)
                        for r in range(world)])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _global_gradients(layer: nn.Module, mesh, expert_names: set[str]) -> None:
    """This rank's gradients -> the global batch's (what the engine's FSDP2 reduction does, written out): each
    rank's loss is a mean over its own tokens, so a replicated parameter's gradient is the sum over all ranks / W;
    an expert shard already holds its EP group's contributions (they came to it through the all-to-all) and sums
    over the replicas of the shard (the DP group) / W."""
    for name, p in layer.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=mesh.dp_group if name in expert_names else None)
        p.grad /= mesh.world_size


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    out = value.detach().clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def _layer_worker(rank: int, world: int, out_dir, cases: list[dict]) -> dict:
    results = {}
    meshes = {}
    for case in cases:
        ep = case["ep"]
        if ep not in meshes:
            meshes[ep] = ep_mesh(ep)
        mesh = meshes[ep]
        layer, x, c = _setup(case, world)
        # Reference: the whole global batch through the unsharded layer with the local dispatcher.
        ref = copy.deepcopy(layer)
        x_ref = x.clone().requires_grad_(True)
        capacity = layer.config.capacity.factor is not None
        autocast = case.get("autocast", False)
        y_ref, loss_ref, dropped = _reference(ref, x_ref, c, world, per_slice=capacity, autocast=autocast)
        loss_ref.backward()
        routing = ref.router(x.to(ref.router.weight.dtype))
        kept = _kept(ref, x, world)

        # Expert-parallel: this rank's slice, this rank's experts.
        stats = CommStats()
        shard_plan = shard_experts(layer, mesh)
        layer.set_dispatcher(DISPATCHERS[case["dispatcher"]](case["experts"], mesh, stats))
        rows = slice(rank * T_PER_RANK, (rank + 1) * T_PER_RANK)
        x_mine = x[rows].clone().requires_grad_(True)
        y, loss, _ = _loss(layer, x_mine, c[rows], autocast)
        loss.backward()
        _global_gradients(layer, mesh, set(shard_plan))
        local = mesh.local_experts(case["experts"])

        # The traffic predicted from the reference routing (and drops) of the EP group's tokens.
        group_ranks = list(range(mesh.dp_rank * ep, (mesh.dp_rank + 1) * ep))
        ids = routing.topk_ids.reshape(world, T_PER_RANK * K)
        in_local = (ids >= local.start) & (ids < local.stop) & kept
        # all_to_all sends rows in the autocast dtype (bf16: 2 bytes), all_gather the tokens as they are.
        row_bytes = D * (2 if autocast and case["dispatcher"] == "all_to_all" else x.element_size())
        padded = layer.config.capacity.pad_to_capacity or layer.execution.moe_backend == "padded"
        cap = (expert_capacity(T_PER_RANK, K, case["experts"], layer.config.capacity.factor,
                               layer.config.capacity.min_capacity)
               if capacity else 0)
        if case["dispatcher"] == "all_to_all" and padded:  # C slots per expert, empty ones included
            predicted_sent, predicted_remote = case["experts"] * cap, (case["experts"] - len(local)) * cap
            predicted_received = ep * len(local) * cap
        elif case["dispatcher"] == "all_to_all":
            predicted_sent = int(kept[rank].sum())
            predicted_remote = int((kept[rank] & ~in_local[rank]).sum())
            predicted_received = int(in_local[group_ranks].sum())
        else:
            predicted_sent, predicted_remote = T_PER_RANK, T_PER_RANK * (ep - 1)
            predicted_received = ep * len(local) * cap if padded else int(in_local[group_ranks].sum())
        results[case["name"]] = {
            "y": _max_diff(y, y_ref[rows]),
            "loss": abs(_mean_over_ranks(loss).item() - loss_ref.item()),
            # Each rank's loss is W times its share of the global loss: its input gradient is W times as large.
            "grad_x": _max_diff(x_mine.grad / world, x_ref.grad[rows]),
            "grad_router": _max_diff(layer.router.weight.grad, ref.router.weight.grad),
            "grad_gate_up": _max_diff(layer.experts.gate_up_proj.grad, ref.experts.gate_up_proj.grad[local.start:local.stop]),
            "grad_down": _max_diff(layer.experts.down_proj.grad, ref.experts.down_proj.grad[local.start:local.stop]),
            "bytes_sent": (stats.dispatch_bytes_sent, predicted_sent * row_bytes),
            "bytes_sent_remote": (stats.dispatch_bytes_sent_remote, predicted_remote * row_bytes),
            "tokens_received": (stats.tokens_received, predicted_received),
            "dropped": dropped,
        }
    return results


CASES_2 = [
    {"name": "ep2_a2a_fp64", "ep": 2, "experts": 4, "dispatcher": "all_to_all", "dtype": "fp64", "backend": "loop"},
    {"name": "ep2_a2a_fp32_grouped", "ep": 2, "experts": 4, "dispatcher": "all_to_all", "dtype": "fp32",
     "backend": "grouped_mm"},
    {"name": "ep2_allgather_fp64", "ep": 2, "experts": 4, "dispatcher": "all_gather", "dtype": "fp64",
     "backend": "loop"},
    {"name": "ep2_a2a_idle_rank", "ep": 2, "experts": 4, "dispatcher": "all_to_all", "dtype": "fp64",
     "backend": "loop", "idle_last_rank": True},
    {"name": "ep2_allgather_idle_rank", "ep": 2, "experts": 4, "dispatcher": "all_gather", "dtype": "fp64",
     "backend": "loop", "idle_last_rank": True},
    {"name": "dp2_ep1", "ep": 1, "experts": 4, "dispatcher": "all_to_all", "dtype": "fp64", "backend": "loop"},
    {"name": "ep2_a2a_capacity_probs", "ep": 2, "experts": 4, "dispatcher": "all_to_all", "dtype": "fp64",
     "backend": "loop", "capacity": {"factor": 0.5}},
    {"name": "ep2_a2a_capacity_padded", "ep": 2, "experts": 4, "dispatcher": "all_to_all", "dtype": "fp64",
     "backend": "padded", "capacity": {"factor": 0.5, "drop_policy": "position"}},
    {"name": "ep2_a2a_bf16_autocast", "ep": 2, "experts": 4, "dispatcher": "all_to_all", "dtype": "fp32",
     "backend": "grouped_mm", "autocast": True, "tol": 2e-2},
    {"name": "ep2_allgather_capacity_padded", "ep": 2, "experts": 4, "dispatcher": "all_gather", "dtype": "fp64",
     "backend": "padded", "capacity": {"factor": 0.5}},
]
CASES_4 = [
    {"name": "ep4_a2a_fp64", "ep": 4, "experts": 8, "dispatcher": "all_to_all", "dtype": "fp64", "backend": "loop"},
    {"name": "ep4_a2a_idle_rank", "ep": 4, "experts": 8, "dispatcher": "all_to_all", "dtype": "fp64",
     "backend": "loop", "idle_last_rank": True},
    {"name": "dp2xep2_a2a_fp64", "ep": 2, "experts": 4, "dispatcher": "all_to_all", "dtype": "fp64",
     "backend": "loop"},
    {"name": "dp2xep2_allgather_fp32", "ep": 2, "experts": 4, "dispatcher": "all_gather", "dtype": "fp32",
     "backend": "grouped_mm"},
    {"name": "ep4_a2a_capacity_fp32", "ep": 4, "experts": 8, "dispatcher": "all_to_all", "dtype": "fp32",
     "backend": "grouped_mm", "capacity": {"factor": 0.5}},
    {"name": "dp2xep2_allgather_capacity", "ep": 2, "experts": 4, "dispatcher": "all_gather", "dtype": "fp64",
     "backend": "loop", "capacity": {"factor": 0.5, "drop_policy": "position"}},
]


# bf16 grouped GEMMs of other group sizes round differently: the bf16 case checks the wiring and the traffic.
TOLERANCE = {c["name"]: c["tol"] for c in CASES_2 + CASES_4 if "tol" in c}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """One 2-process and one 4-process job run every case (process start-up dominates on 2 cores)."""
    out = {}
    for world, cases in ((2, CASES_2), (4, CASES_4)):
        per_rank = spawn(_layer_worker, world, tmp_path_factory.mktemp(f"layer{world}"), cases)
        for case in cases:
            out[case["name"]] = [r[case["name"]] for r in per_rank]
    return out


@pytest.mark.parametrize("name", [c["name"] for c in CASES_2 + CASES_4])
def test_matches_single_process(results, name):
    for rank, r in enumerate(results[name]):
        for key in ("y", "loss", "grad_x", "grad_router", "grad_gate_up", "grad_down"):
            assert r[key] <= TOLERANCE.get(name, 1e-6), (name, rank, key, r[key])


@pytest.mark.parametrize("name", [c["name"] for c in CASES_2 + CASES_4])
def test_traffic_matches_routing(results, name):
    for rank, r in enumerate(results[name]):
        for key in ("bytes_sent", "bytes_sent_remote", "tokens_received"):
            measured, predicted = r[key]
            assert measured == predicted, (name, rank, key, measured, predicted)


def test_idle_rank_really_idle(results):
    """The zero-token cases do leave the last EP rank's experts without tokens (else they test nothing)."""
    assert results["ep2_a2a_idle_rank"][1]["tokens_received"] == (0, 0)
    assert results["ep4_a2a_idle_rank"][3]["tokens_received"] == (0, 0)


@pytest.mark.parametrize("name", [c["name"] for c in CASES_2 + CASES_4 if "capacity" in c])
def test_capacity_cases_really_drop(results, name):
    assert results[name][0]["dropped"] > 0
