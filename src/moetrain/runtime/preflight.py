"""Refuse sizes that cannot fit before anything is allocated or written: the estimate of ``moetrain.analysis``
(weights + gradients + AdamW state, one micro-batch's saved activations, the token batches) against the memory
this machine has free.

Without it a mistyped ``model.hidden=1099511627776`` ended in the allocator's error after asking for 2 PB, and
``train.batch_size=1000000000`` in numpy's ``_ArrayMemoryError``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moetrain.errors import ConfigError

# The estimate leaves out the allocator's slack, temporary buffers and the data set itself, so a run needs more
# than it; refusing only above 100% of free memory never refuses a run that would fit.
_UNITS = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def human_bytes(n: float) -> str:
    """``2.25e15`` -> ``2.2 PB`` (decimal units)."""
    for unit, size in _UNITS:
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def available_memory(device_type: str = "cpu") -> float:
    """Bytes free for this process: ``MemAvailable`` of ``/proc/meminfo`` on Linux (physical RAM elsewhere), or
    the CUDA device's free memory."""
    if device_type == "cuda":
        import torch

        return float(torch.cuda.mem_get_info()[0])
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


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


def estimate_memory(config) -> MemoryEstimate:
    """The estimate for a full :class:`moetrain.config.Config` on one process."""
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
    batches = 2 * 8 * t.batch_size * seq * (1 + t.eval_batches)
    return MemoryEstimate(state=float(state), activations=float(act), batches=float(batches))


def check_fits(config, device_type: str = "cpu", free: float | None = None) -> MemoryEstimate:
    """Refuse a config whose estimate exceeds the free memory, naming the fields that size the larger part.

    Raises:
        ConfigError: the model state (``model.*``) or one micro-batch (``train.batch_size`` x ``data.seq_len``)
            cannot fit; the message gives the estimate and the free memory.
    """
    from moetrain.analysis.shape import ModelShape

    est = estimate_memory(config)
    free = available_memory(device_type) if free is None else free
    if est.total <= free:
        return est
    s, t = ModelShape.from_config(config.model), config.train
    have = f"this machine has {human_bytes(free)} free"
    if est.state >= est.activations + est.batches:
        fields = (f"model.hidden={s.hidden}, model.n_layers={s.n_layers}, model.vocab_size={s.vocab}, "
                  f"{s.num_experts} experts of FFN width {s.expert_ffn}")
        raise ConfigError(f"model.hidden: the model ({fields}) needs about {human_bytes(est.state)} for weights, "
                          f"gradients and AdamW state alone, before any activation; {have}")
    raise ConfigError(f"train.batch_size: one micro-batch of {t.batch_size} x data.seq_len={config.data.seq_len} "
                      f"tokens needs about {human_bytes(est.activations + est.batches)} of activations and token "
                      f"batches (+ {human_bytes(est.state)} of model state); {have}; lower train.batch_size "
                      "(train.grad_accum keeps the global batch)")
