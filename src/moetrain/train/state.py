"""``TrainState``: everything a resume restores (docs/train-state.md).

The model and the optimizer are sharded (this rank's tensors; a sharded checkpoint presents them to DCP by FQN,
``moetrain.parallel.dcp``); the rest is :meth:`TrainState.replicated_state_dict` (identical on every rank: one
rank's copy is written to ``train_state.pt`` and every rank loads it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moetrain.errors import CheckpointError

# The keys of train_state.pt written since format 1 (every one is read back; older checkpoints may lack
# "monitor" and "nonfinite_skips", which then start afresh).
STATE_KEYS = ("step", "optimizer", "scheduler", "sampler", "rng", "initial_val_loss", "config", "monitor",
              "nonfinite_skips")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every global RNG's state, as tensors and plain Python data (loadable with ``torch.load(weights_only=True)``)."""
    numpy_state = np.random.get_state(legacy=True)  # legacy=True is the default: a tuple for the global MT19937
    assert isinstance(numpy_state, tuple)
    kind, keys, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {"python": random.getstate(), "numpy": (kind, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` output (the CUDA states only where CUDA is available)."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainState:
    """The state of one training run on this rank (see the module docstring).

    Attributes:
        model: this rank's model (expert tensors sliced to its experts under expert parallelism).
        optimizer: its optimizer (AdamW).
        scheduler: the LR schedule.
        sampler: the data position: anything with ``state_dict()`` / ``load_state_dict()``
            (``moetrain.data.dataset.BatchSampler``); ``None`` when the caller has no data (weights-only use).
        monitor: the routing monitor (``moetrain.train.monitor.RoutingMonitor``) or ``None``.
        step: optimizer steps completed.
        initial_val_loss: validation loss before training (nats/token), ``None`` until measured.
        nonfinite_total / nonfinite_in_a_row: steps skipped for a non-finite loss or gradient.
        config: the run config as a dict (saved for inspection; never read back by :meth:`load_replicated`).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    sampler: Any = None
    monitor: Any = None
    step: int = 0
    initial_val_loss: float | None = None
    nonfinite_total: int = 0
    nonfinite_in_a_row: int = 0
    config: dict[str, Any] | None = None

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` (parameter indices as keys, as PyTorch writes it), each group naming
        its parameters in PyTorch's own ``param_names`` field (FQNs, in the group's order), so that a one-process
        checkpoint reshards into any layout, a pipeline rank's subset included; the sharded checkpoint re-keys it by
        FQN (``moetrain.parallel.dcp``)."""
        if self.optimizer is None:
            raise CheckpointError("TrainState.optimizer: no optimizer to save")
        state = self.optimizer.state_dict()
        names = {p: n for n, p in self.model.named_parameters()}
        for group, mine in zip(state["param_groups"], self.optimizer.param_groups):
            group.setdefault("param_names", [names[p] for p in mine["params"]])
        return state

    def replicated_state_dict(self, include_optimizer: bool = False) -> dict[str, Any]:
        """Everything but the model (and, unless ``include_optimizer``, the optimizer): the content of
        ``train_state.pt`` (keys :data:`STATE_KEYS`), with every global RNG's state read now."""
        state: dict[str, Any] = {"step": self.step}
        if include_optimizer:  # the key order of format 1's train_state.pt
            state["optimizer"] = self.optimizer_state_dict()
        state |= {
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng_state(), "initial_val_loss": self.initial_val_loss, "config": self.config,
            "monitor": self.monitor.state_dict() if self.monitor is not None else None,
            "nonfinite_skips": (self.nonfinite_total, self.nonfinite_in_a_row),
        }
        return state

    def load_replicated(self, state: dict[str, Any], where: str) -> None:
        """Restore :meth:`replicated_state_dict` output: step, schedule, data position, RNG, counters. The
        monitor's part (``state["monitor"]``) is left to the caller: a monitor is built for the restored step
        (``RoutingMonitor(start_step=...)``), then given it with ``monitor.load_state_dict``.

        Raises:
            CheckpointError: a missing key or a state that does not fit (names ``where``, e.g. the file).
        """
        try:
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            if self.sampler is not None:
                self.sampler.load_state_dict(state["sampler"])
            set_rng_state(state["rng"])
            self.step = int(state["step"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{where}: does not fit this run: "
                                  f"{e.__class__.__name__}: {str(e).splitlines()[0]}") from None
        self.initial_val_loss = state.get("initial_val_loss")
        self.nonfinite_total, self.nonfinite_in_a_row = state.get("nonfinite_skips", (0, 0))
