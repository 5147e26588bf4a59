"""Step-time and memory estimate of one training step for a parallel layout on a given device.

Legend: N = devices, dp / ep / pp = data-, expert- and pipeline-parallel degrees (N = dp * ep * pp; experts are
sharded over ep ranks that are also data-parallel for everything else, as in DeepSpeed-MoE and Megatron-Core),
m = micro-batches per step per data-parallel rank, G = BTA tiles.

Model (stated assumptions, not measurements):
- compute: FLOPs (analysis/flops.py) at ``peak * efficiency``; the expert GEMMs are bounded below by their memory
  traffic (weights read twice and their gradient written once per micro-batch, activations three times) at
  ``mem_bw * efficiency`` (roofline); element-wise work is ignored;
- pipeline: 1F1B schedule, bubble fraction (pp - 1) / m (Narayanan et al., 2021); the first stage holds pp
  micro-batches' activations; blocks split into stages as the trainer splits them (balanced by FLOPs, the
  embedding on the first stage, the LM head on the last: analysis/stages.py);
- communication: the all-to-alls are exposed (they sit between router and experts); the data-parallel gradient
  all-reduce overlaps with backward compute except what exceeds it; pipeline sends are exposed;
- memory: training state (analysis/params.py) with the optimizer sharded over data-parallel replicas when
  ``zero1``, and activations (analysis/activations.py, with autocast's compute-dtype weight copies).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetrain.analysis.activations import model_activations
from moetrain.analysis.comm import all_reduce_bytes, all_to_all_bytes, group_bandwidth, pipeline_bytes, transfer_time
from moetrain.analysis.flops import step_flops
from moetrain.analysis.hardware import Hardware
from moetrain.analysis.intensity import expert_intensity, tokens_per_expert
from moetrain.analysis.params import GRAD_BYTES, ParamCounts, count_params, local_params, state_memory
from moetrain.analysis.shape import ModelShape
from moetrain.analysis.stages import split_stages

MEMORY_HEADROOM = 0.9  # usable fraction of device memory: allocator fragmentation, workspaces, runtime context


@dataclass(frozen=True)
class Layout:
    """A parallel layout: ``dp * ep * pp`` devices."""

    dp: int = 1
    ep: int = 1
    pp: int = 1
    zero1: bool = True

    @property
    def devices(self) -> int:
        return self.dp * self.ep * self.pp

    @property
    def data_parallel(self) -> int:
        """Ranks per pipeline stage that see distinct data (the expert-parallel ranks included)."""
        return self.dp * self.ep

    @property
    def family(self) -> str:
        if self.pp > 1:
            return "EPxPP" if self.ep > 1 else "PPxDP"
        return "EPxDP" if self.ep > 1 else "DP"

    @property
    def label(self) -> str:
        parts = [f"EP{self.ep}"] if self.ep > 1 else []
        parts += [f"PP{self.pp}"] if self.pp > 1 else []
        parts += [f"DP{self.dp}"] if self.dp > 1 or not parts else []
        return " x ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What one step trains: ``global_batch`` sequences of ``seq`` tokens, in micro-batches of ``micro_batch``
    sequences per data-parallel rank, with G = ``bta_tiles``, optional full activation checkpointing, and optional
    recomputed experts (``model.execution.recompute_experts``: the experts save nothing for backward, which reruns their
    input projections)."""

    seq: int
    global_batch: int
    micro_batch: int
    bta_tiles: int = 1
    checkpoint: bool = False
    recompute_experts: bool = False
    act_bytes: int = 2


@dataclass(frozen=True)
class Estimate:
    """Per-device memory (bytes) and per-step times (seconds) of a layout and workload."""

    layout: Layout
    workload: Workload
    grad_accum: int
    state_bytes: float
    activation_bytes: float
    compute_s: float
    bubble_s: float
    exposed_comm_s: float
    tokens_per_expert: float
    expert_intensity: float
    ridge: float
    mem_capacity: float

    @property
    def memory(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.memory <= self.mem_capacity * MEMORY_HEADROOM

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    @property
    def comm_share(self) -> float:
        """Exposed communication time over step time."""
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0


def in_flight(pp: int, m: int, pp_rank: int, per_rank: int = 1, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at its first backward: 1 without a pipeline,
    all ``m`` under GPipe, else ``min(m, pp * per_rank - pp_rank)`` (1F1B-type schedules, ``per_rank`` stages per
    rank)."""
    return 1 if pp == 1 else m if schedule == "gpipe" else min(m, pp * per_rank - pp_rank)


def estimate(
    shape: ModelShape, moe_flags: list[bool], layout: Layout, work: Workload, hw: Hardware,
    counts: ParamCounts | None = None,
) -> Estimate:
    """Estimate memory and step time of ``work`` on ``layout`` with ``hw`` devices (see the module docstring).

    Args:
        moe_flags: per block, whether it is an MoE block (``ModelConfig.is_moe_layer``).
    Raises:
        ValueError: the global batch does not split into whole micro-batches per data-parallel rank, or G does
            not divide the micro-batch.
    """
    counts = counts or count_params(shape)
    per_rank = work.global_batch / layout.data_parallel
    if per_rank != int(per_rank) or int(per_rank) % work.micro_batch or work.micro_batch % work.bta_tiles:
        raise ValueError(
            f"global batch {work.global_batch} over {layout.data_parallel} ranks in micro-batches of "
            f"{work.micro_batch} with {work.bta_tiles} tiles does not divide evenly"
        )
    m = int(per_rank) // work.micro_batch
    # each stage's MoE flags, split as the trainer splits them
    ranges = split_stages(shape, moe_flags, layout.pp, work.seq, work.bta_tiles, "full" if work.checkpoint else "none")
    stages = [[moe_flags[i] for i in r] for r in ranges]
    placed = [(len(f), i == 0, i == len(stages) - 1) for i, f in enumerate(stages)]  # one stage per rank (1F1B)
    tokens = work.micro_batch * work.seq
    eff_flops = hw.peak_flops * hw.efficiency
    parts = step_flops(shape, work.micro_batch, work.seq, work.bta_tiles, work.checkpoint)
    tpe = tokens_per_expert(shape, tokens, layout.ep)
    wb = work.act_bytes
    inten = expert_intensity(shape, tpe, act_bytes=wb, weight_bytes=wb)
    # Forward, backward (2x), plus a whole forward again under full checkpointing, or the input projections'
    # share of one (2 of 3 SwiGLU matrices, 1 of 2 GELU) when only the experts are recomputed.
    passes: float = 3 + (1 if work.checkpoint else 0)
    if work.recompute_experts and not work.checkpoint:
        passes += (shape.expert_mats - 1) / shape.expert_mats

    def stage_seconds(flags: list[bool], last: bool) -> float:
        """Compute of one micro-batch on a stage of blocks ``flags`` (the LM head on the last)."""
        n_moe, n_blocks = sum(flags), len(flags)
        block_share = n_blocks / shape.n_layers
        moe_share = n_moe / shape.moe_layers if shape.moe_layers else 0.0
        dense_share = (n_blocks - n_moe) / shape.dense_layers if shape.dense_layers else 0.0
        share = {"attn_proj": block_share, "attn_scores": block_share, "router": moe_share,
                 "shared_experts": moe_share, "dense_ffn": dense_share, "lm_head": 1.0 if last else 0.0}
        t_other = sum(parts[p].total * f for p, f in share.items()) / eff_flops
        local_experts = shape.num_experts / layout.ep * n_moe
        exp_flops = inten.flops * local_experts * passes
        exp_bytes = (3 * inten.weight_bytes + passes * inten.act_bytes) * local_experts
        return t_other + max(exp_flops / eff_flops, exp_bytes / (hw.mem_bw * hw.efficiency))

    # The slowest stage sets the pipeline's pace.
    micro_s, worst = max((stage_seconds(f, i == len(stages) - 1), i) for i, f in enumerate(stages))
    n_moe = sum(stages[worst])
    compute = m * micro_s
    bubble = (layout.pp - 1) / m * compute if layout.pp > 1 else 0.0

    # Communication per step.
    a2a = all_to_all_bytes(shape, tokens, layout.ep, n_moe, work.act_bytes) * m
    t_a2a = transfer_time(a2a, group_bandwidth(hw, layout.ep), hw)
    dense_local, expert_local = local_params(counts, shape.n_layers, layout.ep, layout.pp, placed)
    t_ar = transfer_time(all_reduce_bytes(dense_local, layout.data_parallel, GRAD_BYTES),
                         group_bandwidth(hw, layout.data_parallel), hw)
    t_ar += transfer_time(all_reduce_bytes(expert_local, layout.dp, GRAD_BYTES),
                          group_bandwidth(hw, layout.dp, stride=layout.ep), hw)
    t_pp = transfer_time(pipeline_bytes(tokens, shape.hidden, layout.pp, work.act_bytes) * m,
                         group_bandwidth(hw, layout.pp, stride=layout.data_parallel), hw)
    exposed = t_a2a + t_pp + max(0.0, t_ar - micro_s * 2 / 3)

    # Memory of the busiest device.
    state = state_memory(counts, shape.n_layers, layout.ep, layout.pp, layout.data_parallel, layout.dp,
                         layout.zero1, placed)
    if work.recompute_experts:
        shape = replace(shape, recompute_experts=True)
    if layout.ep > 1:  # the fused Function is the single-device path; EP dispatches through the all-to-all
        shape = replace(shape, fused_experts=False)
    acts = 0.0  # with autocast this includes each in-flight micro-batch's compute-dtype weight copies
    for i, flags in enumerate(stages):
        last = i == len(stages) - 1
        a = model_activations(shape, flags, work.micro_batch, work.seq, work.bta_tiles, work.checkpoint,
                              work.act_bytes, lm_head=last, fused_loss=True, ep=layout.ep)  # as the trainer runs
        acts = max(acts, (sum(a.blocks) + a.other) * in_flight(layout.pp, m, i) + a.transient)
    return Estimate(
        layout=layout, workload=work, grad_accum=m, state_bytes=state.total,
        activation_bytes=acts, compute_s=compute, bubble_s=bubble, exposed_comm_s=exposed,
        tokens_per_expert=tpe, expert_intensity=inten.intensity, ridge=hw.ridge, mem_capacity=hw.mem_bytes,
    )
