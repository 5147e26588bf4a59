"""Hot/cold experts under a memory budget: hot experts resident, cold ones memory-mapped from a safetensors file and
paged in on demand through an LRU (``moetrain serve --expert-memory-budget BYTES``; docs/serving.md).

Legend: T = tokens, D = hidden, E = experts, K = top-k, F = expert FFN hidden, R = dispatched rows.

Each (MoE layer, expert) pair is one unit: its ``w_in`` [2F, D] (or GELU ``up_proj`` [F, D]) and ``down_proj``
[D, F] rows. Units are ranked by their share of their layer's assignments
(:class:`~moetrain.serve.expert_usage.ExpertUsage`); the hottest are *pinned* (never evicted) up to ``hot_share``
of the budget, the rest of the budget is an LRU pool that starts filled with the next hottest. A unit not resident
when a step needs it is copied from the memory-mapped file (only our copy counts as resident), after evicting least
recently used pool units until it fits.

The store is the layer's weight provider: the layer's per-expert loop (:func:`moetrain.moe.experts.expert_loop`)
asks it for one expert at a time, resident ones first, so the budget only needs to hold one expert beyond the
pinned set. Outputs equal the layer's fused kernel up to float summation order (tests/test_serve_experts.py).

The file: a run directory's single-format ``model.safetensors`` is mapped as it is (checked against the loaded
weights once, at start); otherwise (a Hugging Face directory, a sharded checkpoint) the loaded experts are written
once to a spill file in our layout. After the store is built the model's own expert weights are released (meta
tensors), so the steady state holds at most ``budget`` bytes of routed experts; start-up holds the whole model once.
"""

from __future__ import annotations

import collections
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moetrain.errors import MoetrainError
from moetrain.moe.experts import expert_loop
from moetrain.serve.expert_usage import ExpertUsage

Unit = tuple[int, int]  # (transformer block, expert)


def expert_tensor_names(block: int, activation: str) -> tuple[str, str]:
    """The state-dict names of a block's routed-expert weights: (w_in, w_out)."""
    w_in = "gate_up_proj" if activation == "swiglu" else "up_proj"
    return f"blocks.{block}.ffn.experts.{w_in}", f"blocks.{block}.ffn.experts.down_proj"


def release_experts(model, blocks: list[int]) -> None:
    """Replace the routed-expert weights of ``model``'s MoE ``blocks`` by meta tensors (same shapes and dtypes): the
    model then runs its experts only through a weight provider."""
    for b in blocks:
        ex = model.blocks[b].ffn.experts
        for name in ("gate_up_proj" if ex.activation == "swiglu" else "up_proj", "down_proj"):
            p = getattr(ex, name)
            setattr(ex, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                 requires_grad=False))


def unit_bytes(model) -> int:
    """Bytes of one expert (w_in + w_out rows) in the model's expert dtype (all MoE layers are alike)."""
    ex = model.moe_layers()[0].experts
    return (ex.w_in[0].numel() + ex.down_proj[0].numel()) * ex.down_proj.element_size()


def routed_expert_bytes(model) -> int:
    """Bytes of every routed expert of every MoE layer."""
    layers = model.moe_layers()
    return unit_bytes(model) * layers[0].experts.num_experts * len(layers)


@dataclass
class StoreStats:
    """Counters of an :class:`ExpertStore`: ``hits`` / ``misses`` (page-ins) / ``evictions`` of units needed by
    steps, ``peak_bytes`` the most resident bytes ever measured, ``checks`` how many times they were measured."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    peak_bytes: int = 0
    checks: int = 0


class ExpertStore:
    """Routed experts of ``model`` under ``budget`` bytes (see the module docstring).

    Args:
        model: the served :class:`~moetrain.model.transformer.MoETransformer` (experts loaded; they are released).
        budget: most bytes of resident routed experts.
        usage: expert usage (hot = high share of its layer's assignments).
        weights_file: a safetensors file holding ``blocks.{b}.ffn.experts.*`` [E, ...] equal to the model's; ``None``
            = write a spill file under ``spill_dir`` (default: the system temporary directory; deleted on close).
        hot_share: share of ``budget`` for pinned units (the rest is the LRU pool).
    Raises:
        MoetrainError: budget below one expert, no MoE layers, or a weights file whose experts differ from the
            loaded model's (naming the tensor).
    """

    def __init__(self, model, budget: int, usage: ExpertUsage, weights_file: str | Path | None = None,
                 hot_share: float = 0.5, spill_dir: str | None = None):
        from safetensors import safe_open

        layers = model.moe_layers()
        if not layers:
            raise MoetrainError("--expert-memory-budget: the model has no MoE layers")
        if not 0 <= hot_share <= 1:
            raise MoetrainError(f"--hot-share: must be in [0, 1], got {hot_share}")
        self.unit = unit_bytes(model)
        if budget < self.unit:
            raise MoetrainError(f"--expert-memory-budget: {budget} bytes is less than one expert ({self.unit} bytes)")
        self.budget = budget
        self.blocks = [i for i, b in enumerate(model.blocks) if b.is_moe]
        self._layer_blocks = {id(model.blocks[b].ffn): b for b in self.blocks}  # the provider gets the layer
        self.activation = layers[0].experts.activation
        self.dtype = layers[0].experts.down_proj.dtype
        self.stats = StoreStats()
        self._spill: str | None = None
        if weights_file is None:
            weights_file = self._write_spill(model, spill_dir)
        self._file = safe_open(str(weights_file), framework="pt")
        self._check_file(model, str(weights_file))
        self.pinned: dict[Unit, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool: collections.OrderedDict[Unit, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        self._warm(usage, hot_share)
        release_experts(model, self.blocks)  # the store holds what is resident
        self.measure()

    # --- the file ------------------------------------------------------------------------------------------
    def _write_spill(self, model, spill_dir: str | None) -> str:
        from safetensors.torch import save_file

        tensors = {}
        for b in self.blocks:
            ex = model.blocks[b].ffn.experts
            n_in, n_out = expert_tensor_names(b, self.activation)
            tensors[n_in], tensors[n_out] = ex.w_in.detach().contiguous(), ex.down_proj.detach().contiguous()
        fd, path = tempfile.mkstemp(prefix="moetrain-experts-", suffix=".safetensors", dir=spill_dir)
        os.close(fd)
        save_file(tensors, path)
        self._spill = path
        return path

    def _check_file(self, model, where: str) -> None:
        for b in self.blocks:
            ex = model.blocks[b].ffn.experts
            for name, w in zip(expert_tensor_names(b, self.activation), (ex.w_in, ex.down_proj)):
                try:
                    same = torch.equal(self._file.get_tensor(name).to(w.dtype), w.detach())
                except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                    raise MoetrainError(f"{where}: cannot read {name}: {e}") from None
                if not same:
                    raise MoetrainError(f"{where}: {name} differs from the loaded model's weights (a newer "
                                        "checkpoint written over it?)")

    def _read(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy one expert's rows out of the memory-mapped file into tensors of their own (a slice from
        ``get_slice`` is a view whose storage spans the whole [E, ...] tensor of the mapping: kept as it is, it would
        pin every expert of the layer; ``resident_bytes`` measures storages, so it would show)."""
        b, e = unit
        n_in, n_out = expert_tensor_names(b, self.activation)
        return (self._file.get_slice(n_in)[e].to(self.dtype).clone(),
                self._file.get_slice(n_out)[e].to(self.dtype).clone())

    def _warm(self, usage: ExpertUsage, hot_share: float) -> None:
        """Pin the hottest units up to ``hot_share * budget``, then fill the pool with the next hottest."""
        shares = usage.shares()  # [L, E]
        ranked = sorted(((float(shares[usage.blocks.index(b), e]), b, e) for b in self.blocks
                         for e in range(shares.shape[1])), key=lambda r: (-r[0], r[1], r[2]))
        pin_limit = int(hot_share * self.budget)
        if self.budget - (pin_limit // self.unit) * self.unit < self.unit:  # the pool must hold one expert
            pin_limit = self.budget - self.unit
        order = [(b, e) for _, b, e in ranked]
        n_pin = min(len(order), max(0, pin_limit) // self.unit)
        for unit in order[:n_pin]:
            self.pinned[unit] = self._read(unit)
        room = (self.budget - n_pin * self.unit) // self.unit
        for unit in reversed(order[n_pin:n_pin + room]):  # least hot first: the first to be evicted
            self.pool[unit] = self._read(unit)

    # --- residency -----------------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of the storages behind every resident tensor (each storage once), measured, not computed."""
        seen: dict[int, int] = {}
        for w_in, w_out in (*self.pinned.values(), *self.pool.values()):
            for t in (w_in, w_out):
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    def measure(self) -> int:
        """Measure the resident bytes, keep the peak, and raise if they exceed the budget.

        Raises:
            RuntimeError: more than ``budget`` bytes resident (a bug in the store).
        """
        n = self.resident_bytes()
        self.stats.peak_bytes, self.stats.checks = max(self.stats.peak_bytes, n), self.stats.checks + 1
        if n > self.budget:
            raise RuntimeError(f"expert store: {n} bytes resident, budget {self.budget}")
        return n

    def get(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """A unit's (w_in [2F or F, D], w_out [D, F]), paging it in (and evicting LRU pool units) if needed."""
        if unit in self.pinned:
            self.stats.hits += 1
            return self.pinned[unit]
        if unit in self.pool:
            self.stats.hits += 1
            self.pool.move_to_end(unit)
            return self.pool[unit]
        self.stats.misses += 1
        while self.pool and (len(self.pinned) + len(self.pool) + 1) * self.unit > self.budget:
            self.pool.popitem(last=False)  # least recently used; its tensors are freed here
            self.stats.evictions += 1
        self.pool[unit] = self._read(unit)
        self.measure()
        return self.pool[unit]

    def is_resident(self, unit: Unit) -> bool:
        return unit in self.pinned or unit in self.pool

    # --- compute -------------------------------------------------------------------------------------------
    def experts_forward(self, layer, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The routed experts of ``layer`` from the store (its :data:`~moetrain.moe.layer.ExpertProvider`): rows
        [R, D] grouped by expert, tokens_per_expert [E] int64 -> [R, D] in the store's dtype, by the per-expert loop
        (:func:`~moetrain.moe.experts.expert_loop`) with the store as its :data:`~moetrain.moe.experts.ExpertWeights`."""
        block = self._layer_blocks[id(layer)]

        def weights(used: list[int]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, None, None]]:
            used = sorted(used, key=lambda e: not self.is_resident((block, e)))  # hits first: misses may evict them
            return ((e, *self.get((block, e)), None, None) for e in used)  # paged in as the loop reaches each

        return expert_loop(rows, tokens_per_expert, weights, self.activation, self.dtype)

    def close(self) -> None:
        """Drop the resident units and delete the spill file (if one was written)."""
        self.pinned.clear()
        self.pool.clear()
        if self._spill is not None:
            Path(self._spill).unlink(missing_ok=True)
            self._spill = None

    def __del__(self) -> None:
        spill = getattr(self, "_spill", None)
        if spill is not None:
            Path(spill).unlink(missing_ok=True)
