"""Routing statistics accumulated on the device, read by the host only at logging steps.

Legend: L = MoE layers, T = tokens, E = experts, K = top-k, P = queued steps, W = window (steps).

Every micro-batch adds about five tiny kernels per layer, every step a few more (its :class:`StepSummary` rows);
the queued steps are folded into the accumulators in one vectorised batch of about 20 kernels per logging interval.
Nothing is read back between logging steps: :meth:`RoutingStats.snapshot` copies every accumulator to the host at
once.

Definitions (per MoE layer, over one logging interval unless noted):

- ``tokens[e]``: (token, expert) assignments routed to expert ``e`` (real tokens; before any capacity drop).
- ``cv``: coefficient of variation of ``tokens`` over experts, ``std / mean`` with the population std (0 =
  perfectly balanced; Shazeer et al., 2017, "importance" loss uses the same statistic).
- ``overload``: ``max(tokens) / mean(tokens)`` (1 = balanced; a capacity factor below it drops tokens).
- ``max_share``: the largest fraction of the layer's tokens that chose one expert, ``max(tokens) / (sum / K)``
  (balanced = K / E, collapse -> 1).
- ``idle[e]``: optimizer steps since expert ``e`` last received a token (tracked every step, not per interval).
- ``window_tokens[e]``: assignments to expert ``e`` over the last ``collapse_window`` steps (all steps so far when
  fewer), a rolling window independent of the logging interval; the collapse alarm's share is computed from it.
- ``drop_fraction``: dropped assignments / assigned ones, when the layer's record reports a dropped count
  (a field whose name contains ``drop``: a scalar, or [E] per expert, then also kept as ``dropped[e]``);
  ``None`` otherwise.
- ``entropy``: mean over tokens of the entropy (nats) of ``softmax(router_logits)`` (uniform = ln E).
- ``router_z``: mean over tokens of ``logsumexp(router_logits)`` (the z of ST-MoE's z-loss, Zoph et al., 2022,
  eq. 5, before squaring).
- ``losses``: every scalar field of the layer's record whose name ends in ``loss`` (unweighted), averaged over
  micro-batches.

Router logits carry no padding mask, so entropy and z include padded positions (training batches have none).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import torch


@dataclass
class LayerStats:
    """Host-side statistics of one MoE layer over one logging interval (definitions in the module docstring)."""

    layer: int
    tokens: list[float]
    cv: float | None
    overload: float | None
    max_share: float | None
    idle: list[int]
    window_tokens: list[float]
    drop_fraction: float | None
    entropy: float | None
    router_z: float | None
    dropped: list[float] | None = None
    losses: dict[str, float] = field(default_factory=dict)
    bias: list[float] | None = None


@dataclass
class Snapshot:
    """Everything read back at one logging step.

    Attributes:
        step: the logging step.
        first_step: first optimizer step of the interval (``step - steps + 1``).
        steps: optimizer steps in the interval.
        layers: one :class:`LayerStats` per MoE layer, in block order.
        spike_ratio: the largest ``loss / rolling median`` of the interval (``None`` before ``spike_warmup`` steps
            of history, or when every loss of the interval was non-finite).
        spike_step / spike_loss: the step and LM loss where ``spike_ratio`` was reached.
        nonfinite_steps: steps of the interval whose LM loss was NaN or infinite.
        nonfinite_step: the last such step (``None`` if none).
    """

    step: int
    first_step: int
    steps: int
    layers: list[LayerStats]
    spike_ratio: float | None = None
    spike_step: int | None = None
    spike_loss: float | None = None
    nonfinite_steps: int = 0
    nonfinite_step: int | None = None
    window_steps: int = 0


def entropy_and_z_sums(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over the T tokens of the router entropy and of ``logsumexp(l)``, in about five kernels (this runs for
    every layer of every micro-batch): ``log_softmax``, ``exp``, one dot product ``sum p log p`` over all T * E
    entries, and ``lse = l_0 - log_softmax(l)_0`` (no separate logsumexp pass).

    Args:
        logits: [T, E] router logits (any float dtype; computed in fp32).
    Returns:
        (sum_t H_t, sum_t lse_t): scalar fp32 tensors.
    """
    logits = logits.detach().float()
    dim = -1
    if logits.device.type == "cpu" and logits.shape[-1] <= 32:
        # CPU reductions over a short last dim run row by row (~20x slower than over a long one at E = 4): reduce
        # over dim 0 of the [E, T] transpose instead (one copy of T * E floats).
        logits, dim = logits.t().contiguous(), 0
    log_p = torch.log_softmax(logits, dim=dim)
    # H = -sum p log p; exp(log_p) * log_p is never 0 * -inf because router logits are finite.
    entropy_sum = -torch.dot(log_p.exp().reshape(-1), log_p.reshape(-1))
    first, first_log_p = logits.select(dim, 0), log_p.select(dim, 0)  # [T]: logit and log-prob of expert 0
    z_sum = (first - first_log_p).sum()  # log_softmax(l)_0 = l_0 - lse(l)
    return entropy_sum, z_sum


def find_loss_fields(record: Any) -> list[str]:
    """Names of the scalar loss fields of an MoE record (dataclass fields whose name ends in ``loss``)."""
    fields = dataclasses.fields(record) if dataclasses.is_dataclass(record) else ()
    return [f.name for f in fields if f.name.endswith("loss")]


def _device_index(cache: dict[tuple[int, ...], torch.Tensor], values: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    """Device int64 tensor of ``values``, cached in ``cache``: the index patterns repeat from one step or interval to
    the next, so each costs one host-to-device copy per run."""
    if values not in cache:
        if len(cache) > 64:
            cache.clear()
        cache[values] = torch.tensor(values, dtype=torch.int64, device=device)
    return cache[values]


class StepSummary:
    """One rank's per-step sums of its MoE layers' records, as one [L, W] float64 tensor in a fixed layout: what
    :class:`RoutingStats` accumulates (:meth:`RoutingStats.end_step`), and what a pipeline stage sends to the rank
    that writes metrics (summed over the stages, each layer on exactly one of them, so the sum is their union).

    Row layout (per layer; K = ``len(loss_names)``, offsets in the attributes):

    - device part: entropy sum, z sum, dropped sum (scalar drop reports), then (from ``loss``) the K loss sums;
    - ``host``: micro-batches, tokens (router rows), micro-batches reporting drops, of them per expert, expert bias
      present (0 / 1), then K counts: micro-batches reporting that loss;
    - ``vectors``: tokens [E], dropped [E] (per-expert drop reports), the router's expert bias [E] after the step.

    Args:
        n_layers: L, the MoE layers of the whole model (rows; a rank fills its own).
        num_experts: E.
        loss_names: the record's loss fields (``find_loss_fields`` of the record class), the same on every rank.
        device: where the rows live.
    """

    def __init__(self, n_layers: int, num_experts: int, loss_names: list[str], device: torch.device):
        self.n_layers, self.num_experts, self.loss_names, self.device = n_layers, num_experts, list(loss_names), device
        k = len(self.loss_names)
        self.loss = 3  # first loss sum
        self.host = 3 + k  # first host-side column
        self.vectors = self.host + 5 + k  # first vector column
        self.width = self.vectors + 3 * num_experts
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._zero, self._zero_e = torch.zeros((), device=device), torch.zeros(num_experts, device=device)
        self._drop_field: dict[type, str | None] = {}  # record class -> its dropped-count field
        self._reset()

    def _reset(self) -> None:
        self._pos: list[int] = []  # per record its layer, its device sums (host scalars) and vectors (2 of [E])
        self._sums: list[torch.Tensor] = []
        self._vectors: list[torch.Tensor] = []
        self._host = [[0.0] * (5 + len(self.loss_names)) for _ in range(self.n_layers)]

    def add(self, pos: int, record: Any) -> None:
        """Add one micro-batch of layer ``pos`` (0-based among MoE layers): about five small kernels, no host sync.

        Args:
            pos: the layer's row.
            record: the layer's record (``moetrain.moe.layer.MoEAux``): ``tokens_per_expert`` [E],
                ``router_logits`` [T, E], scalar ``*loss`` fields, optionally a dropped count (scalar or [E]).
        """
        e, host, zero = self.num_experts, self._host[pos], self._zero
        kind = type(record)
        if kind not in self._drop_field:  # the first dataclass field whose name contains "drop" (None: dropless)
            fields = dataclasses.fields(record) if dataclasses.is_dataclass(record) else ()
            self._drop_field[kind] = next((f.name for f in fields if "drop" in f.name), None)
        drop = self._drop_field[kind]
        dropped = getattr(record, drop) if drop else None
        per_expert, drop_sum = self._zero_e, zero
        if isinstance(dropped, torch.Tensor):
            host[2] += 1
            if dropped.numel() == e:  # per expert: the total is summed at the snapshot
                per_expert = dropped.detach().float()
                host[3] += 1
            else:
                drop_sum = dropped.detach().float().sum()
        # Queued unstacked (take stacks the step's records at once: each tensor call costs microseconds of Python),
        # but detached: a queued loss would keep the step's autograd graph alive.
        self._sums += [*entropy_and_z_sums(record.router_logits), drop_sum]
        for k, name in enumerate(self.loss_names):
            value = getattr(record, name, None)
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                self._sums.append(value.detach().float())
                host[5 + k] += 1
            else:
                self._sums.append(zero)
        self._vectors += [record.tokens_per_expert.detach().float(), per_expert]
        self._pos.append(pos)
        host[0] += 1
        host[1] += record.router_logits.shape[0]

    def take(self, biases: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """The step's rows [L, W] (zeros for layers this rank did not observe), then start the next step.

        Args:
            biases: optional [E] aux-loss-free bias per layer (``None`` where the layer has none or is not here).
        """
        f64, e, v = torch.float64, self.num_experts, self.vectors
        rows = torch.zeros(self.n_layers, self.width, device=self.device, dtype=f64)
        if self._pos:
            idx = _device_index(self._index_cache, tuple(self._pos), self.device)
            n = len(self._pos)
            rows[:, :self.host].index_add_(0, idx, torch.stack(self._sums).view(n, self.host).to(f64))
            rows[:, v:v + 2 * e].index_add_(0, idx, torch.stack(self._vectors).view(n, 2 * e).to(f64))
        for pos, b in enumerate(biases or []):
            if b is not None:
                rows[pos, v + 2 * e:] = b.detach().to(f64)
                self._host[pos][4] = 1.0
        rows[:, self.host:v] = torch.tensor(self._host, dtype=f64).view(self.n_layers, v - self.host).to(self.device)
        self._reset()
        return rows


class RoutingStats:
    """Device-side accumulators for L MoE layers of E experts each (top-K routing).

    Feed it with :meth:`observe` (every training micro-batch, every MoE layer; or a :class:`StepSummary` of one's
    own) and :meth:`end_step` (after each optimizer step); read it with :meth:`snapshot` at logging steps, which also
    starts a new interval. Each step's :class:`StepSummary` rows are queued and folded at each snapshot or
    every ``FOLD_EVERY`` steps, the per-step quantities (idle experts, the collapse window) vectorised over the
    queued steps; the non-finite and loss-spike checks run on the host over every step.

    Args:
        layer_ids: [L] transformer-block index of each MoE layer (names the layer in every output).
        num_experts: E.  top_k: K.
        device: where the accumulators live (the model's device).
        spike_window: rolling-median window of the loss-spike check (steps).
        spike_warmup: finite losses the window must hold before a step is checked.
        start_step: optimizer steps already done (idle counts start here).
        collapse_window: steps in the rolling window of ``window_tokens`` (the collapse alarm's share).
    """

    FOLD_EVERY = 32  # steps queued at most (bounds the queue when logging steps are far apart)

    def __init__(self, layer_ids: list[int], num_experts: int, top_k: int, device: torch.device,
                 spike_window: int = 50, spike_warmup: int = 10, start_step: int = 0, collapse_window: int = 20):
        self.layer_ids, self.num_experts, self.top_k, self.device = list(layer_ids), num_experts, top_k, device
        self.spike_window, self.spike_warmup, self.collapse_window = spike_window, spike_warmup, collapse_window
        n_layers = len(self.layer_ids)
        f64: dict[str, Any] = {"device": device, "dtype": torch.float64}
        # Interval accumulators, float64 so counts stay exact far beyond fp32's 2**24.
        self.counts = torch.zeros(n_layers, num_experts, **f64)  # [L, E] this interval
        self.dropped = torch.zeros(n_layers, num_experts, **f64)  # [L, E] this interval, when reported per expert
        # Per-step counts of the last W steps (a ring; zeros before the run has W steps), for the collapse share.
        self.window = torch.zeros(collapse_window, n_layers, num_experts, **f64)  # [W, L, E]
        self.steps_seen = 0  # steps folded so far (host int: indexes the ring)
        self.last_seen = torch.full((n_layers, num_experts), float(start_step), **f64)  # [L, E] step
        # The record layout (loss fields), fixed by the first record or summary seen.
        self.summary: StepSummary | None = None
        self.scalars: torch.Tensor | None = None  # [L, summary.vectors] interval sums of the scalar and host columns
        # The queue: per closed step its number, rows [L, W] (None: nothing observed yet) and LM loss.
        self._steps: list[int] = []
        self._rows: list[torch.Tensor | None] = []
        self._losses: list[torch.Tensor | None] = []
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        # LM losses stay on the device until a snapshot reads them with everything else; the loss-spike and
        # non-finite checks then run on the host, over every step (a few floats per step, no per-step kernels).
        self._loss_chunks: list[torch.Tensor] = []  # folded [P] float64 losses (NaN: none reported)
        self._loss_steps: list[int] = []  # their step numbers
        self.loss_history: list[float] = []  # the last W losses, oldest first (NaN: non-finite)
        self.spike: tuple[float, int, float] | None = None  # this interval's (max ratio, its step, its loss)
        self.nonfinite_count = 0
        self.nonfinite_last: int | None = None
        self.step = start_step
        self.interval_start = start_step

    def _layout(self, loss_names: list[str]) -> StepSummary:
        """The record layout, fixed by the first record or summary seen (or a checkpoint): this instance's own
        :class:`StepSummary`, which :meth:`observe` fills.

        Raises:
            ValueError: ``loss_names`` differ from the layout's.
        """
        if self.summary is None:
            self.summary = StepSummary(len(self.layer_ids), self.num_experts, loss_names, self.device)
            self.scalars = torch.zeros(len(self.layer_ids), self.summary.vectors, device=self.device,
                                       dtype=torch.float64)
        elif self.summary.loss_names != list(loss_names):
            raise ValueError(f"routing statistics: loss fields {list(loss_names)}, the earlier records' were "
                             f"{self.summary.loss_names}")
        return self.summary

    # -- per micro-batch ---------------------------------------------------------------------------------------
    def observe(self, pos: int, record: Any) -> None:
        """Add one micro-batch of MoE layer ``pos`` (0-based among MoE layers) to this instance's own
        :class:`StepSummary` (:meth:`StepSummary.add`). No host sync."""
        (self.summary or self._layout(find_loss_fields(record))).add(pos, record)

    # -- per optimizer step ------------------------------------------------------------------------------------
    def end_step(self, step: int, lm_loss: torch.Tensor | float | None = None, summary: StepSummary | None = None,
                 rows: torch.Tensor | None = None) -> None:
        """Close optimizer step ``step`` (1-based count of steps done) with its LM loss (a scalar tensor; a float
        works too) and its records' sums. A few kernels (the step's rows), no host sync.

        Args:
            summary: the :class:`StepSummary` the step's records were added to; default: the one :meth:`observe`
                fills.
            rows: [L, W] float64 the step's rows in ``summary``'s layout (a pipeline's sum over its ranks, each layer
                on one of them); default: ``summary.take()``.
        Raises:
            ValueError: ``summary`` has other loss fields than the records seen before.
        """
        if self._steps and step != self._steps[-1] + 1:
            self._fold()  # a fold assumes consecutive steps (their numbers are made on the device from the first)
        self.step = step
        self._steps.append(step)
        if summary is not None:
            self._layout(summary.loss_names)
        source = summary if summary is not None else self.summary
        self._rows.append(rows if rows is not None or source is None else source.take())
        if lm_loss is not None and not isinstance(lm_loss, torch.Tensor):
            lm_loss = torch.tensor(float(lm_loss))
        self._losses.append(lm_loss)
        if len(self._steps) >= self.FOLD_EVERY:
            self._fold()

    @torch.no_grad()
    def _fold(self) -> None:
        """Fold the closed steps of the queue into the accumulators (device kernels only)."""
        p = len(self._steps)
        if p == 0:
            return
        n_layers, e, f64 = len(self.layer_ids), self.num_experts, torch.float64
        if self.summary is not None and self.scalars is not None:
            v = self.summary.vectors
            zeros = torch.zeros(n_layers, self.summary.width, device=self.device, dtype=f64)
            rows = torch.stack([zeros if r is None else r for r in self._rows])  # [P, L, W]
            self.scalars += rows[:, :, :v].sum(dim=0)
            self.dropped += rows[:, :, v + e:v + 2 * e].sum(dim=0)
            step_counts = rows[:, :, v:v + e]  # [P, L, E]
        else:
            step_counts = torch.zeros(p, n_layers, e, device=self.device, dtype=f64)
        self.counts += step_counts.sum(dim=0)
        # Collapse window: this batch's steps go to the next ring slots (only the last W matter).
        keep = min(p, self.collapse_window)
        slots = tuple((self.steps_seen + i) % self.collapse_window for i in range(p - keep, p))
        self.window.index_copy_(0, _device_index(self._index_cache, slots, self.device),
                                step_counts[p - keep:].contiguous())
        # Idle experts: the last step of the batch in which each expert had a token (0 = none; steps are >= 1).
        first = self._steps[0]  # steps are consecutive: step i of the batch is first + i
        step_no = torch.arange(first, first + p, device=self.device, dtype=f64)  # [P]
        last = ((step_counts > 0) * step_no[:, None, None]).amax(dim=0)  # [L, E]
        torch.maximum(self.last_seen, last, out=self.last_seen)
        if any(loss is not None for loss in self._losses):
            if any(loss is None for loss in self._losses):
                nan = torch.full((), math.nan, device=self.device)
                self._losses = [nan if x is None else x for x in self._losses]
            losses = cast(list[torch.Tensor], self._losses)  # no None left
            self._loss_chunks.append(torch.stack(losses).to(self.device, f64).reshape(-1))
            self._loss_steps += self._steps
        self.steps_seen += p
        self._steps, self._rows, self._losses = [], [], []

    def _check_losses(self, losses: list[float]) -> None:
        """Non-finite losses and loss spikes of the steps in ``self._loss_steps`` (host side): each step's loss is
        compared with the median of the ``spike_window`` losses before it (non-finite ones left out; the lower
        middle value for an even count, as ``torch.median``), once that window holds ``spike_warmup`` finite
        losses."""
        for step, loss in zip(self._loss_steps, losses):
            if not math.isfinite(loss):
                self.nonfinite_count += 1
                self.nonfinite_last = step
            finite = sorted(x for x in self.loss_history if not math.isnan(x))
            if math.isfinite(loss) and len(finite) >= self.spike_warmup:
                median = finite[(len(finite) - 1) // 2]
                ratio = loss / median if median != 0 else math.inf
                if self.spike is None or ratio > self.spike[0]:
                    self.spike = (ratio, step, loss)
            self.loss_history = [*self.loss_history, loss if math.isfinite(loss) else math.nan][-self.spike_window:]
        self._loss_chunks, self._loss_steps = [], []

    def _read_losses(self) -> torch.Tensor | None:
        return torch.cat(self._loss_chunks) if self._loss_chunks else None

    # -- at logging steps --------------------------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, biases: list[torch.Tensor | None] | None = None) -> Snapshot:
        """Read every accumulator with one device-to-host copy, then start a new interval.

        Args:
            biases: optional [E] tensor per layer (aux-loss-free routing biases) to read in the same copy.
        Returns:
            :class:`Snapshot` of the interval ending at the last :meth:`end_step`.
        """
        self._fold()
        n_layers, e = len(self.layer_ids), self.num_experts
        biases = biases if biases is not None else [None] * n_layers
        losses = self._read_losses()
        parts = [self.counts.flatten(), self.last_seen.flatten(), self.dropped.flatten(),
                 self.window.sum(dim=0).flatten()]
        if self.scalars is not None:
            parts.append(self.scalars.flatten())
        if losses is not None:
            parts.append(losses)
        parts += [b.detach().reshape(-1).to(self.device, torch.float64) for b in biases if b is not None]
        host = iter(torch.cat(parts).tolist())  # the one host sync of the interval

        def take(n: int) -> list[float]:
            return list(itertools.islice(host, n))

        counts, last_seen, dropped, window = (take(n_layers * e) for _ in range(4))
        layout = self.summary
        width = 0 if layout is None else layout.vectors
        scalar_rows = take(n_layers * width)
        self._check_losses(take(len(self._loss_steps)) if losses is not None else [])
        layers = []
        for i, layer_id in enumerate(self.layer_ids):
            tokens = counts[i * e:(i + 1) * e]
            row = scalar_rows[i * width:(i + 1) * width]
            layer = LayerStats(
                layer=layer_id, tokens=tokens, **load_statistics(tokens, self.top_k),
                idle=[int(self.step - s) for s in last_seen[i * e:(i + 1) * e]],
                window_tokens=window[i * e:(i + 1) * e],
                drop_fraction=None, entropy=None, router_z=None,
            )
            if layout is not None and row[layout.host] > 0:  # micro-batches observed
                n_obs, n_tok, flags = row[layout.host], row[layout.host + 1], row[layout.host + 2:]
                layer.entropy, layer.router_z = row[0] / n_tok, row[1] / n_tok
                layer.losses = {name: row[layout.loss + k] / n_obs for k, name in enumerate(layout.loss_names)
                                if flags[3 + k]}
                assigned = sum(tokens)
                if flags[0] and assigned > 0:  # drops reported (flags[1]: per expert)
                    layer.dropped = dropped[i * e:(i + 1) * e] if flags[1] else None
                    layer.drop_fraction = (row[2] + sum(layer.dropped or [])) / assigned
            bias = biases[i]
            if bias is not None:
                layer.bias = take(bias.numel())
            layers.append(layer)
        snap = Snapshot(step=self.step, first_step=self.interval_start + 1, steps=self.step - self.interval_start,
                        layers=layers, nonfinite_steps=self.nonfinite_count, nonfinite_step=self.nonfinite_last,
                        window_steps=min(self.steps_seen, self.collapse_window))
        if self.spike is not None:
            snap.spike_ratio, snap.spike_step, snap.spike_loss = self.spike
        self.counts.zero_()  # a new interval
        self.dropped.zero_()
        if self.scalars is not None:
            self.scalars.zero_()
        self.spike, self.nonfinite_count, self.nonfinite_last = None, 0, None
        self.interval_start = self.step
        return snap

    # -- checkpointing -----------------------------------------------------------------------------------------
    _TENSORS = ("counts", "last_seen", "dropped", "window")
    _VALUES = ("steps_seen", "step", "interval_start", "loss_history", "spike", "nonfinite_count", "nonfinite_last")

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly after a resume (tensors copied to CPU; take it between steps:
        the queue is folded first, and the losses read: one host sync)."""
        self._fold()
        losses = self._read_losses()
        self._check_losses(losses.tolist() if losses is not None else [])
        state: dict[str, Any] = {k: getattr(self, k).detach().cpu().clone() for k in self._TENSORS}
        state.update({k: copy.copy(getattr(self, k)) for k in self._VALUES})
        state["loss_names"] = None if self.summary is None else list(self.summary.loss_names)
        state["scalars"] = None if self.scalars is None else self.scalars.detach().cpu().clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a state from another layer / expert / window layout, or from a version
        before these tensors, is ignored (the run then starts its statistics afresh). A state written before the
        :class:`StepSummary` layout (no ``loss_names``) restores all but the interval's entropy, z and loss sums."""
        if (any(k not in state for k in (*self._TENSORS, *self._VALUES, "scalars"))
                or any(tuple(state[k].shape) != tuple(getattr(self, k).shape) for k in self._TENSORS)):
            return
        for name in self._TENSORS:
            getattr(self, name).copy_(state[name].to(self.device))
        for name in self._VALUES:
            setattr(self, name, copy.copy(state[name]))
        if state.get("loss_names") is not None:
            self._layout(state["loss_names"])
            self.scalars = state["scalars"].to(self.device)


class LoadStatistics(TypedDict):
    """What :func:`load_statistics` returns (:class:`LayerStats` fields of the same names)."""

    cv: float | None
    overload: float | None
    max_share: float | None


def load_statistics(tokens: list[float], top_k: int) -> LoadStatistics:
    """``cv``, ``overload`` and ``max_share`` of one layer's per-expert assignment counts (``None`` when the layer
    saw no tokens). See the module docstring for the definitions."""
    total = sum(tokens)
    if total <= 0:
        return {"cv": None, "overload": None, "max_share": None}
    mean = total / len(tokens)
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / len(tokens))
    return {"cv": std / mean, "overload": max(tokens) / mean, "max_share": max(tokens) / (total / top_k)}
