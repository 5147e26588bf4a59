"""Routing statistics accumulated on the device, read by the host only at logging steps.

Legend: L = MoE layers, T = tokens, E = experts, K = top-k, W = loss-spike window (steps).

Every micro-batch adds a handful of tiny kernels per layer (an [T, E] logsumexp and softmax-weighted sum, a few
[E] and [L, C] adds); nothing is read back, so the GPU never waits on the host between logging steps. At a logging
step :meth:`RoutingStats.snapshot` concatenates every accumulator into one float64 vector and copies it to the host
once (one sync per logging interval, on top of the trainer's own).

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

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

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


def routing_entropy_and_z(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean router entropy and mean z of one batch of router logits.

    Args:
        logits: [T, E] router logits (any float dtype; computed in fp32).
    Returns:
        (entropy, z): scalar fp32 tensors, the means over T of ``H(softmax(l)) = lse(l) - sum_e p_e l_e`` (nats)
        and of ``lse(l) = logsumexp(l)``.
    """
    logits = logits.detach().float()
    lse = torch.logsumexp(logits, dim=-1)  # [T]
    probs = torch.exp(logits - lse[:, None])  # [T, E]
    # H = -sum p log p = -sum p (l - lse) = lse - sum p l; avoids 0 * log 0 for saturated routers.
    entropy = lse - (probs * logits).sum(dim=-1)  # [T]
    return entropy.mean(), lse.mean()


def find_drop_field(record: Any) -> str | None:
    """Name of the dropped-count field of an MoE record (the first dataclass field whose name contains ``drop``),
    or ``None`` when the record has none (dropless layers)."""
    if not dataclasses.is_dataclass(record):
        return None
    return next((f.name for f in dataclasses.fields(record) if "drop" in f.name), None)


def find_loss_fields(record: Any) -> list[str]:
    """Names of the scalar loss fields of an MoE record (dataclass fields whose name ends in ``loss``)."""
    if not dataclasses.is_dataclass(record):
        return []
    return [f.name for f in dataclasses.fields(record) if f.name.endswith("loss")]


class RoutingStats:
    """Device-side accumulators for L MoE layers of E experts each (top-K routing).

    Feed it with :meth:`observe` (every training micro-batch, every MoE layer) and :meth:`end_step` (after each
    optimizer step); read it with :meth:`snapshot` at logging steps, which also starts a new interval.

    Args:
        layer_ids: [L] transformer-block index of each MoE layer (names the layer in every output).
        num_experts: E.  top_k: K.
        device: where the accumulators live (the model's device).
        spike_window / spike_warmup: rolling-median window and minimum history (steps) of the loss-spike check.
        collapse_window: steps in the rolling window of ``window_tokens`` (the collapse alarm's share).
        start_step: optimizer steps already done (idle counts start here).
    """

    def __init__(self, layer_ids: list[int], num_experts: int, top_k: int, device: torch.device,
                 spike_window: int = 50, spike_warmup: int = 10, start_step: int = 0, collapse_window: int = 20):
        self.layer_ids, self.num_experts, self.top_k, self.device = list(layer_ids), num_experts, top_k, device
        self.spike_window, self.spike_warmup, self.collapse_window = spike_window, spike_warmup, collapse_window
        n_layers = len(self.layer_ids)
        f64 = {"device": device, "dtype": torch.float64}
        # Interval accumulators, float64 so counts stay exact far beyond fp32's 2**24.
        self.counts = torch.zeros(n_layers, num_experts, **f64)  # [L, E] this interval
        self.step_counts = torch.zeros(n_layers, num_experts, **f64)  # [L, E] this step (for idle tracking)
        self.dropped = torch.zeros(n_layers, num_experts, **f64)  # [L, E] this interval, when reported per expert
        self.dropped_per_expert = False
        # Per-step counts of the last W steps (a ring; zeros before the run has W steps), for the collapse share.
        self.window = torch.zeros(collapse_window, n_layers, num_experts, **f64)  # [W, L, E]
        self.steps_seen = 0  # steps closed by end_step (host int: indexes the rings)
        self.last_seen = torch.full((n_layers, num_experts), float(start_step), **f64)  # [L, E] step
        self.loss_terms: list[str] | None = None  # fixed by the first record seen
        self.drop_field: str | None = None
        self.scalars: torch.Tensor | None = None  # [L, 3 + n_terms]: entropy, z, dropped, *loss terms (sums)
        self.observed = [0] * n_layers  # micro-batches seen per layer this interval (host ints: no sync)
        # Loss-spike state: a ring of the last W finite losses (NaN = empty slot) and interval maxima.
        self.loss_ring = torch.full((spike_window,), float("nan"), **f64)  # [W]
        self.losses_seen = 0
        self.spike = torch.full((3,), float("nan"), **f64)  # (max ratio, its step, its loss)
        self.nonfinite = torch.zeros(2, **f64)  # (count, last step)
        self.step = start_step
        self.interval_start = start_step

    # -- per micro-batch ---------------------------------------------------------------------------------------
    def _init_columns(self, record: Any) -> None:
        self.loss_terms = find_loss_fields(record)
        self.drop_field = find_drop_field(record)
        self.scalars = torch.zeros(len(self.layer_ids), 3 + len(self.loss_terms), device=self.device,
                                   dtype=torch.float64)

    @torch.no_grad()
    def observe(self, pos: int, record: Any) -> None:
        """Add one micro-batch of MoE layer ``pos`` (0-based among MoE layers).

        Args:
            pos: position of the layer in ``layer_ids``.
            record: the layer's record (``moetrain.moe.layer.MoEAux``): ``tokens_per_expert`` [E],
                ``router_logits`` [T, E], scalar ``*loss`` fields, optionally a dropped count (scalar or [E]).
        """
        if self.scalars is None:
            self._init_columns(record)
        counts = record.tokens_per_expert.detach().to(torch.float64)  # [E]
        self.step_counts[pos] += counts
        entropy, z = routing_entropy_and_z(record.router_logits)
        values = [entropy, z]
        dropped = getattr(record, self.drop_field, None) if self.drop_field else None
        if isinstance(dropped, torch.Tensor):
            dropped = dropped.detach()
            if dropped.numel() == self.num_experts:
                self.dropped[pos] += dropped.reshape(-1).to(torch.float64)
                self.dropped_per_expert = True
            values.append(dropped.sum().float())
        else:
            values.append(entropy.new_zeros(()))
        for name in self.loss_terms:
            value = getattr(record, name, None)
            values.append(value.detach().float().reshape(()) if isinstance(value, torch.Tensor)
                          else entropy.new_zeros(()))
        self.scalars[pos] += torch.stack(values).to(torch.float64)
        self.observed[pos] += 1

    # -- per optimizer step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def end_step(self, step: int, lm_loss: torch.Tensor | float | None = None) -> None:
        """Close optimizer step ``step`` (1-based count of steps done) with its LM loss (scalar tensor or float)."""
        self.step = step
        self.counts += self.step_counts
        self.window[self.steps_seen % self.collapse_window] = self.step_counts
        self.steps_seen += 1
        self.last_seen.masked_fill_(self.step_counts > 0, float(step))
        self.step_counts.zero_()
        if lm_loss is None:
            return
        loss = torch.as_tensor(lm_loss, device=self.device).detach().to(torch.float64).reshape(())
        finite = torch.isfinite(loss)
        self.nonfinite[0] += (~finite).to(torch.float64)
        self.nonfinite[1] = torch.where(finite, self.nonfinite[1], float(step))
        if self.losses_seen >= self.spike_warmup:
            median = torch.nanmedian(self.loss_ring)
            ratio = torch.where(finite, loss / median, float("nan"))
            # NaN-safe "ratio > best": a NaN best (no ratio yet) is replaced by any finite ratio.
            better = (ratio > self.spike[0]) | (torch.isnan(self.spike[0]) & ~torch.isnan(ratio))
            update = torch.stack([ratio, torch.full_like(ratio, float(step)), loss])  # a fill, not a host copy
            self.spike.copy_(torch.where(better, update, self.spike))
        # Non-finite losses stay out of the median (NaN slots are skipped by nanmedian).
        self.loss_ring[self.losses_seen % self.spike_window] = torch.where(finite, loss, float("nan"))
        self.losses_seen += 1

    # -- at logging steps --------------------------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, biases: list[torch.Tensor | None] | None = None) -> Snapshot:
        """Read every accumulator with one device-to-host copy, then start a new interval.

        Args:
            biases: optional [E] tensor per layer (aux-loss-free routing biases) to read in the same copy.
        Returns:
            :class:`Snapshot` of the interval ending at the last :meth:`end_step`.
        """
        n_layers, e = len(self.layer_ids), self.num_experts
        biases = biases if biases is not None else [None] * n_layers
        scalars = self.scalars if self.scalars is not None else torch.zeros(n_layers, 3, device=self.device,
                                                                            dtype=torch.float64)
        parts = [self.counts.flatten(), self.last_seen.flatten(), self.dropped.flatten(),
                 self.window.sum(dim=0).flatten(), scalars.flatten(),
                 self.spike, self.nonfinite]
        parts += [b.detach().reshape(-1).to(self.device, torch.float64) for b in biases if b is not None]
        host = torch.cat(parts).tolist()  # the one host sync of the interval

        def take(n: int) -> list[float]:
            nonlocal host
            out, host = host[:n], host[n:]
            return out

        counts, last_seen, dropped = take(n_layers * e), take(n_layers * e), take(n_layers * e)
        window = take(n_layers * e)
        scalar_rows = take(scalars.numel())
        spike, nonfinite = take(3), take(2)
        terms = self.loss_terms or []
        width = 3 + len(terms)
        layers = []
        for i, layer_id in enumerate(self.layer_ids):
            tokens = counts[i * e:(i + 1) * e]
            row = scalar_rows[i * width:(i + 1) * width]
            n_obs = self.observed[i]
            layer = LayerStats(
                layer=layer_id, tokens=tokens, **load_statistics(tokens, self.top_k),
                idle=[int(self.step - s) for s in last_seen[i * e:(i + 1) * e]],
                window_tokens=window[i * e:(i + 1) * e],
                drop_fraction=None, entropy=None, router_z=None,
            )
            if n_obs:
                layer.entropy, layer.router_z = row[0] / n_obs, row[1] / n_obs
                layer.losses = {name: row[3 + j] / n_obs for j, name in enumerate(terms)}
                assigned = sum(tokens)
                if self.drop_field is not None and assigned > 0:
                    layer.drop_fraction = row[2] / assigned
                    if self.dropped_per_expert:
                        layer.dropped = dropped[i * e:(i + 1) * e]
            if biases[i] is not None:
                layer.bias = take(biases[i].numel())
            layers.append(layer)
        snap = Snapshot(step=self.step, first_step=self.interval_start + 1, steps=self.step - self.interval_start,
                        layers=layers, nonfinite_steps=int(nonfinite[0]),
                        window_steps=min(self.steps_seen, self.collapse_window),
                        nonfinite_step=int(nonfinite[1]) if nonfinite[0] > 0 else None)
        if not math.isnan(spike[0]):
            snap.spike_ratio, snap.spike_step, snap.spike_loss = spike[0], int(spike[1]), spike[2]
        self._reset_interval()
        return snap

    def _reset_interval(self) -> None:
        self.counts.zero_()
        self.dropped.zero_()
        if self.scalars is not None:
            self.scalars.zero_()
        self.observed = [0] * len(self.layer_ids)
        self.spike.fill_(float("nan"))
        self.nonfinite.zero_()
        self.interval_start = self.step

    # -- checkpointing -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly after a resume (tensors copied to CPU)."""
        tensors = {"counts": self.counts, "last_seen": self.last_seen, "dropped": self.dropped, "window": self.window,
                   "loss_ring": self.loss_ring, "spike": self.spike, "nonfinite": self.nonfinite}
        state: dict[str, Any] = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        state.update(loss_terms=self.loss_terms, drop_field=self.drop_field,
                     dropped_per_expert=self.dropped_per_expert, observed=list(self.observed),
                     losses_seen=self.losses_seen, steps_seen=self.steps_seen, step=self.step,
                     interval_start=self.interval_start,
                     scalars=None if self.scalars is None else self.scalars.detach().cpu().clone())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a state from a different layer/expert layout is ignored (the run
        then starts its statistics afresh)."""
        if ("window" not in state or tuple(state["counts"].shape) != tuple(self.counts.shape)
                or state["loss_ring"].numel() != self.spike_window
                or tuple(state["window"].shape) != tuple(self.window.shape)):
            return
        for name in ("counts", "last_seen", "dropped", "window", "loss_ring", "spike", "nonfinite"):
            getattr(self, name).copy_(state[name].to(self.device))
        self.loss_terms, self.drop_field = state["loss_terms"], state["drop_field"]
        self.dropped_per_expert = state["dropped_per_expert"]
        self.scalars = None if state["scalars"] is None else state["scalars"].to(self.device)
        self.observed, self.losses_seen = list(state["observed"]), state["losses_seen"]
        self.step, self.interval_start = state["step"], state["interval_start"]
        self.steps_seen = state["steps_seen"]


def load_statistics(tokens: list[float], top_k: int) -> dict[str, float | None]:
    """``cv``, ``overload`` and ``max_share`` of one layer's per-expert assignment counts (``None`` when the layer
    saw no tokens). See the module docstring for the definitions."""
    total = sum(tokens)
    if total <= 0:
        return {"cv": None, "overload": None, "max_share": None}
    mean = total / len(tokens)
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / len(tokens))
    return {"cv": std / mean, "overload": max(tokens) / mean, "max_share": max(tokens) / (total / top_k)}
