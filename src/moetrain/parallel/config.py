"""Configuration of expert/data parallelism (the ``parallel`` section of the run config).

No process groups or devices live here (they come from the ``torchrun`` environment at launch): the data-parallel
size is derived, ``dp_replicate = WORLD_SIZE / (pp * dp_shard * ep)``, and checked by
:meth:`moetrain.parallel.layout.Layout.from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.configlib import require, require_at_least


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The ``pp x dp_replicate x dp_shard x ep`` mesh and how each dimension runs (docs/scale-out.md), expert
    parallelism (EP) carved out of data parallelism as in torchtitan / Megatron-Core.

    Fields:
        ep: expert-parallel size (ranks per EP group); must divide ``model.moe.num_experts`` and ``WORLD_SIZE``.
        dispatcher: ``all_to_all`` (each token travels only to the ranks holding its experts; uneven splits) or
            ``all_gather`` (every rank gathers all tokens of its EP group, computes its experts on them, and a
            reduce-scatter returns the partial outputs; simpler, ``ep`` times more traffic).
        timeout_s: seconds a collective may wait for a peer before every rank fails with an error naming the
            collective (``init_process_group(timeout=...)`` and every sub-group's; honoured by gloo, and by NCCL's
            watchdog, which moetrain sets to raise in the training thread instead of tearing the process down:
            ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless the environment sets it, see
            :func:`moetrain.parallel.layout.nccl_error_handling`).
        backend: ``auto`` (NCCL on CUDA, gloo on CPU), ``gloo`` or ``nccl``.
        pp: pipeline-parallel size (stages of the block stack, ``torch.distributed.pipelining``).
        dp_shard: FSDP2 sharding degree: non-expert parameters, gradients and AdamW state are sharded over the
            ``dp_shard x ep`` ranks of a stage, expert shards over the ``dp_shard`` ranks that replicate them.
            1 with ``ep == 1``: plain data parallelism (replicated weights, gradients all-reduced in backward).
        dp_replicate: replicas of the sharded group (HSDP); 0 = the rest, ``WORLD_SIZE / (pp * dp_shard * ep)``.
            World layout: ``WORLD_SIZE = pp * dp_replicate * dp_shard * ep`` (EP borrowed from data parallelism:
            every rank of a stage reads its own rows of the batch).
        reshard_after_forward: FSDP2 ZeRO-3 (``True``: parameters freed after forward and all-gathered again in
            backward) or ZeRO-2 (``False``: only gradients and optimizer state stay sharded).
        cpu_offload: FSDP2 ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory; needs
            CUDA: on a CPU run the parameters are already in host memory; refused for plain data parallelism,
            which has no shards).
        activation_checkpoint: ``none``, ``full`` (every block recomputed in backward) or ``selective`` (each
            block's attention branch and routed experts recomputed; router, norms and dispatch kept).
        pp_schedule: ``1f1b``, ``interleaved_1f1b`` (needs ``pp_stages_per_rank >= 2``), ``gpipe``, or the
            V-shaped zero-bubble schedules of ``torch.distributed.pipelining`` (``pp_stages_per_rank == 2``; rank
            ``r`` holds stages ``r`` and ``2 pp - 1 - r``, and backward is split into input- and weight-gradient
            passes that fill the bubble): ``zbv`` (``ScheduleZBVZeroBubble``, Qi et al., 2024, "Zero Bubble
            Pipeline Parallelism", section 6) and ``dualpipev`` (``ScheduleDualPipeV``, the V variant of DeepSeek-V3's
            DualPipe; without a registered overlap callback its forward / backward pairs run one after the other);
            both need ``reshard_after_forward = false``.
        pp_stages_per_rank: pipeline stages (virtual stages) per rank.
        meta_init: deprecated and ignored (accepted so that older run directories' configs still load): every
            layout, one process included, builds on the meta device and initialises from global indices
            (:mod:`moetrain.parallel.meta_init`).
        fsdp: accepted for older configs and ignored (``off`` still needs ``dp_shard == pp == 1``): every
            ``torchrun`` job runs on FSDP2 (:mod:`moetrain.parallel.engine`); with ``dp_shard == 1`` the
            non-expert parameters are sharded over the ``ep`` ranks of a replica (none with ``ep == 1``: plain
            data parallelism, gradients all-reduced over the replicas).
    """

    ep: int = 1
    dispatcher: Literal["all_to_all", "all_gather"] = "all_to_all"
    timeout_s: float = 600.0
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    pp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 0
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe", "zbv", "dualpipev"] = "1f1b"
    pp_stages_per_rank: int = 1
    meta_init: bool = False
    fsdp: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        require_at_least(self, 1, "ep", "pp", "dp_shard", "pp_stages_per_rank")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        require_at_least(self, 0, "dp_replicate", note="0 = the rest of the world")
        require(self.pp_schedule != "interleaved_1f1b" or self.pp_stages_per_rank >= 2, "pp_stages_per_rank",
                f"pp_schedule='interleaved_1f1b' needs at least 2 stages per rank, got {self.pp_stages_per_rank}")
        require(self.pp_schedule not in ("zbv", "dualpipev") or self.pp_stages_per_rank == 2, "pp_stages_per_rank",
                f"pp_schedule='{self.pp_schedule}' places exactly 2 stages per rank in a V, got "
                f"{self.pp_stages_per_rank}")
        # Between a micro-batch's input-gradient pass and its weight-gradient pass the split-backward schedules run
        # other forwards, whose FSDP2 reshard swaps the stage's parameters back to their shards: the weight pass
        # then misses them (ZBV: no gradient; DualPipeV: wrong ones, measured in torch 2.13 on gloo).
        require(self.pp_schedule not in ("zbv", "dualpipev") or not self.reshard_after_forward,
                "reshard_after_forward", f"pp_schedule='{self.pp_schedule}' splits backward into input- and "
                "weight-gradient passes, which FSDP2's reshard after forward breaks; set it to false (ZeRO-2, "
                "torchtitan's default with pipelining)")
        require(self.fsdp != "off" or (self.dp_shard == 1 and self.pp == 1), "fsdp",
                f"'off' (plain data parallel) cannot shard or pipeline; got dp_shard={self.dp_shard}, pp={self.pp}")
