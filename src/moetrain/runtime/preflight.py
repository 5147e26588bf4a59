"""Refuse sizes that cannot fit before anything is allocated or written: the estimate of ``moetrain.analysis``
(weights + gradients + AdamW state, one micro-batch's saved activations, the token batches) against the memory
this machine has free, so that a mistyped size ends in one line naming the field instead of the allocator's error.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from moetrain.errors import ConfigError

_UNITS = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))
# Threads a CPU rank of a distributed run starts: gloo's ProcessGroupGloo runs two workers ("pt_gloo_runloop") and
# its TCP device one event loop ("gloo_tcp_loop") per process group; rank 0 one more, the metrics writer's (as
# /proc/<pid>/task/*/comm lists them).
GLOO_THREADS_PER_GROUP, RANK0_THREADS = 3, 1


def human_bytes(n: float) -> str:
    """``2.25e15`` -> ``2.2 PB`` (decimal units)."""
    for unit, size in _UNITS:
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def available_memory(device_type: str = "cpu") -> float:
    """Bytes free for this process: ``MemAvailable`` of ``/proc/meminfo`` on Linux (physical RAM elsewhere), or
    less where a per-process limit leaves less (:func:`process_limit`); or the CUDA device's free memory."""
    if device_type == "cuda":
        import torch

        return float(torch.cuda.mem_get_info()[0])
    free = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                free = float(line.split()[1]) * 1024
    limit = process_limit()
    return free if limit is None else min(free, limit[1])


def process_limit() -> tuple[str, float] | None:
    """The tighter of this process's ``RLIMIT_DATA`` and ``RLIMIT_AS`` soft limits (``ulimit -d`` / ``-v``, a
    scheduler's or a benchmark's cap) as (name, bytes still free under it: the limit minus ``VmData`` / ``VmSize``
    of ``/proc/self/status``); ``None`` without a limit."""
    import resource

    use = {}
    try:
        for line in open("/proc/self/status"):
            key, _, rest = line.partition(":")
            if key in ("VmData", "VmSize"):
                use[key] = float(rest.split()[0]) * 1024
    except OSError:
        return None
    found = []
    for name, which, key in (("RLIMIT_DATA", resource.RLIMIT_DATA, "VmData"),
                             ("RLIMIT_AS", resource.RLIMIT_AS, "VmSize")):
        soft = resource.getrlimit(which)[0]
        if soft != resource.RLIM_INFINITY and key in use:
            found.append((name, max(float(soft) - use[key], 0.0)))
    return min(found, key=lambda f: f[1]) if found else None


def thread_stack_bytes() -> int:
    """Address space one new thread maps for its stack (bytes): glibc's default, the ``RLIMIT_STACK`` soft limit
    (8 MiB on most systems; 2 MiB when unlimited), which a thread keeps mapped, though barely resident, while it
    runs."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return 2 * 2**20 if soft == resource.RLIM_INFINITY else int(soft)


def reserved_bytes(config, world: int, device_type: str = "cpu") -> float:
    """Address space the busiest CPU rank of ``config`` on ``world`` ranks maps beyond the resident memory that
    :func:`moetrain.parallel.memory.rank_memory` predicts, which an address-space limit (``RLIMIT_DATA`` /
    ``RLIMIT_AS``) counts: the stacks of the threads gloo starts per process group
    (:func:`moetrain.parallel.layout.process_groups`, :data:`GLOO_THREADS_PER_GROUP`) and rank 0's metrics writer
    (:func:`thread_stack_bytes` each); 0 for one process or on CUDA (the limit is the GPU's memory there).
    The processes' own memory before training (interpreter, PyTorch) is the ``VmData`` / ``VmSize`` this check
    subtracts from the limit (:func:`process_limit`): a rank has the same when it runs the check."""
    from moetrain.parallel.layout import Layout, process_groups

    if world == 1 or device_type != "cpu":
        return 0.0
    groups = process_groups(Layout.from_config(config.parallel, world))
    return float((GLOO_THREADS_PER_GROUP * groups + RANK0_THREADS) * thread_stack_bytes())


def sharded_suggestion(config, free: float, device_type: str = "cpu", address_space: bool = False) -> str:
    """The smallest FSDP2 layout (``parallel.dp_shard = N``, N = 2, 4, ... 64) whose busiest rank's
    :func:`estimate_memory` fits ``free`` bytes (``address_space``: what an address-space limit leaves), as a phrase
    for an error message."""
    from dataclasses import replace

    from moetrain.errors import MoetrainError
    from moetrain.parallel.config import ParallelConfig

    shards = (2, 4, 8, 16, 32, 64) if estimate_memory(config).state / 64 <= free else ()  # else none can fit
    for n in shards:
        try:
            layout = replace(config, parallel=ParallelConfig(dp_shard=n), train=replace(config.train,
                             batch_size=max(config.train.batch_size, n) // n * n))
            need = estimate_memory(layout, n, device_type, address_space).total
        except (MoetrainError, RuntimeError):  # a layout this model cannot take (e.g. experts over shards)
            continue
        if need <= free:
            gpus = " (one GPU each)" if device_type == "cuda" else ""
            return (f"try parallel.dp_shard={n} on {n} processes{gpus}: `torchrun --nproc_per_node {n} -m moetrain "
                    f"train ... parallel.dp_shard={n}` (about {human_bytes(need)} per process)")
    return "no dp_shard of up to 64 processes fits either; see `moetrain plan`"


def out_of_memory(error: BaseException, config, world: int) -> str | None:
    """``error`` as one line when it is an allocator's out-of-memory failure during training (CPU:
    ``DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes``; CUDA: ``torch.OutOfMemoryError``),
    naming the request, the memory this process had (and the per-process limit that set it) and the layouts to try;
    ``None`` for any other error. Raised where the estimate (:func:`check_fits`) let the run start but a step needed
    more than it: the allocator's slack is not in the estimate (with glibc's defaults, the heaps its threads keep, which
    an address-space limit (``RLIMIT_DATA`` / ``RLIMIT_AS``) counts even when freed)."""
    import re

    import torch

    text = str(error)
    cpu = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", text)
    if cpu is None and not isinstance(error, torch.OutOfMemoryError):
        return None
    asked = f"allocating {human_bytes(float(cpu.group(1)))}" if cpu else "a CUDA allocation"
    limit = process_limit() if cpu else None
    have = f" under its {limit[0]} limit" if limit is not None else ""
    shards = config.parallel.dp_shard * 2
    return (f"out of memory: {asked} failed in this process{have} (a step needed more than the estimate that let the "
            f"run start, `moetrain train --dry-run --world-size {world}`); give each process less: "
            f"parallel.dp_shard={shards} on {world * 2} processes, parallel.activation_checkpoint=full or a smaller "
            "train.batch_size (train.grad_accum keeps the global batch)")


def _batch_bytes(config) -> float:
    t, seq = config.train, config.data.seq_len
    return float(2 * 8 * t.batch_size * seq * (1 + t.eval_batches))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training step needs (analysis module estimates).

    Attributes:
        state: weights + gradients + AdamW moments (16 bytes per parameter).
        activations: saved-for-backward bytes of one micro-batch.
        batches: the int64 inputs and targets of one micro-batch and of the validation set.
    """

    state: float
    activations: float
    batches: float

    @property
    def total(self) -> float:
        return self.state + self.activations + self.batches


def estimate_memory(config, world: int = 1, device_type: str = "cpu", address_space: bool = False) -> MemoryEstimate:
    """The estimate for a full :class:`moetrain.config.Config`: on one process the analysis modules'; on
    ``world > 1`` ranks the busiest rank's (:func:`moetrain.parallel.memory.rank_memory`), everything at its peak
    but its activations counted as state (shards, gathered copies, collective buffers, MoE scratch, the runtime;
    with ``address_space``, a per-process address-space limit, its threads' stacks: :func:`reserved_bytes`)."""
    if world > 1:
        from moetrain.parallel.memory import rank_memory

        busiest = max(rank_memory(config, world, device=device_type), key=lambda r: r.total)
        reserved = reserved_bytes(config, world, device_type) if address_space else 0.0
        return MemoryEstimate(state=busiest.total - busiest.activations + reserved, activations=busiest.activations,
                              batches=_batch_bytes(config))
    from moetrain.analysis.activations import model_activations
    from moetrain.analysis.params import count_params, state_memory
    from moetrain.analysis.shape import ModelShape

    model, t = config.model, config.train
    shape = ModelShape.from_config(model)
    counts = count_params(shape)
    state = state_memory(counts, shape.n_layers).total
    flags = [model.is_moe_layer(i) for i in range(model.n_layers)]
    seq = config.data.seq_len
    act = model_activations(shape, flags, t.batch_size, seq, act_bytes=2 if t.dtype == "bf16" else 4,
                            fused_loss=True).peak
    return MemoryEstimate(state=float(state), activations=float(act), batches=_batch_bytes(config))


def check_fits(config, device_type: str = "cpu", free: float | None = None, world: int = 1) -> MemoryEstimate:
    """Refuse a config whose estimate (:func:`estimate_memory`: the busiest rank's on ``world > 1`` ranks, with its
    threads' stacks where a per-process address-space limit sets the free memory) exceeds the free memory, naming
    the fields that size the larger part.

    Raises:
        ConfigError: the model state (``model.*``) or one micro-batch (``train.batch_size`` x ``data.seq_len``)
            cannot fit; the message gives the estimate, the free memory (and the per-process limit that sets it)
            and, for the model state, the smallest ``parallel.dp_shard`` layout that fits.
    """
    from moetrain.analysis.shape import ModelShape

    limit = process_limit() if free is None and device_type == "cpu" else None
    free = available_memory(device_type) if free is None else free
    address_space = limit is not None and limit[1] <= free  # the limit sets the free memory
    est = estimate_memory(config, world, device_type, address_space)
    if est.total <= free:
        return est
    s, t = ModelShape.from_config(config.model), config.train
    have = f"this machine has {human_bytes(free)} free"
    if address_space and limit is not None:
        have = f"this process may use {human_bytes(free)} more under its {limit[0]} limit"
    if est.state >= est.activations + est.batches:
        fields = (f"model.hidden={s.hidden}, model.n_layers={s.n_layers}, model.vocab_size={s.vocab}, "
                  f"{s.num_experts} experts of FFN width {s.expert_ffn}")
        where = "per rank " if world > 1 else ""
        raise ConfigError(f"model.hidden: the model ({fields}) needs about {human_bytes(est.state)} {where}for "
                          f"weights, gradients and AdamW state alone, before any activation; {have} (out of "
                          f"memory); {sharded_suggestion(config, free, device_type, address_space)}")
    raise ConfigError(f"train.batch_size: one micro-batch of {t.batch_size} x data.seq_len={config.data.seq_len} "
                      f"tokens needs about {human_bytes(est.activations + est.batches)} of activations and token "
                      f"batches (+ {human_bytes(est.state)} of model state); {have}; lower train.batch_size "
                      "(train.grad_accum keeps the global batch)")
