"""moetrain's MoE inside Hugging Face models (the HF ``Trainer`` integration; public as :mod:`moetrain.hf`):
:func:`accelerate` swaps the sparse MoE blocks of a transformers Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / dots.llm1
/ DeepSeek-V3 model in place for moetrain's dispatch and grouped-GEMM experts, and :class:`MoELoggingCallback` logs
the per-layer routing statistics to an HF ``Trainer``'s loggers.

Legend: B = batch, S = sequence, T = B * S tokens, D = hidden, E = experts, K = top-k.

What is swapped and what is kept. The new block owns the *same* submodules (hence the same ``nn.Parameter``
objects, state-dict names, optimizer state and ``save_pretrained`` output): ``gate`` (the HF router module, still
called, so that transformers' output recorder hooks on it keep returning ``router_logits`` for the aux loss of
``output_router_logits=True``, and so that the routing decision, dtype and tie-breaking are transformers' own),
``experts`` (its ``gate_up_proj`` [E, 2F, D] / ``down_proj`` [E, D, F] tensors), and the shared expert where the
family has one. What changes is the expert computation: transformers loops over the hit experts in Python, one
pair of small matmuls and an ``index_add`` each; moetrain sorts the T * K assignments once, runs two
``grouped_mm`` calls over all experts and combines with a gather (moe/dispatch.py, moe/experts.py).

Routing statistics (Switch aux loss, router z-loss, tokens per expert, from moe/losses.py) are recorded in
training mode into the :class:`HFRoutingSums` that :func:`accelerate` returns, because an HF decoder layer only
passes a tensor through its MLP: no return value can carry them. They count every token of the batch, padding
included (the block does not see the attention mask), and a block recomputed by gradient checkpointing records
twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from moetrain.errors import ConfigError
from moetrain.interop.hf import transformers_module
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.experts import BACKENDS
from moetrain.moe.losses import expert_counts, router_z_loss, switch_load_balancing_loss
from moetrain.moe.router import route
from moetrain.moe.shared_expert import shared_output

# Block class name -> (router score function, shared expert attribute or None, whether the shared expert is gated).
SUPPORTED_BLOCKS = {
    "MixtralSparseMoeBlock": ("softmax", None, False),
    "Qwen2MoeSparseMoeBlock": ("softmax", "shared_expert", True),
    "Qwen3MoeSparseMoeBlock": ("softmax", None, False),
    "OlmoeSparseMoeBlock": ("softmax", None, False),
    "Dots1MoE": ("sigmoid", "shared_experts", False),
    "DeepseekV3MoE": ("sigmoid", "shared_experts", False),  # the MoE block only: the attention (MLA) stays HF's
}
_EXPERT_BACKENDS = ("grouped_mm", "loop")  # of moetrain.moe.experts.BACKENDS: the ones with no layout of their own


@dataclass
class _LayerSums:
    tokens_per_expert: torch.Tensor  # [E] fp32 assignments summed over recorded forwards
    aux_loss: torch.Tensor  # [] summed Switch losses
    z_loss: torch.Tensor  # [] summed z-losses
    forwards: int = 0


class HFRoutingSums:
    """Per-layer routing statistics summed since the last :meth:`reset`, filled by the accelerated blocks.

    Not the trainer's :class:`moetrain.train.routing_stats.RoutingStats` (device-side windows, alarms and
    per-step idle counts, fed with moetrain's layer records at step boundaries): an HF decoder layer passes only a
    tensor through its MLP and no step boundary, so these are plain sums between two Trainer logs.

    Sums stay on the model's device; only :meth:`summary` reads them (one host sync per log, not per step).

    Attributes:
        layers: the decoder layer index of each accelerated block, in model order.
    """

    def __init__(self) -> None:
        self.layers: list[int] = []
        self._sums: dict[int, _LayerSums] = {}

    @torch.no_grad()
    def record(self, layer: int, logits: torch.Tensor, topk_ids: torch.Tensor, score_func: str) -> None:
        """Add one forward pass of ``layer``: logits [T, E], topk_ids [T, K] int64."""
        e = logits.shape[-1]
        logits = logits.detach().float()
        probs = route(logits, topk_ids.shape[-1], score_func=score_func).probs  # [T, E] as our router's
        s = self._sums.get(layer)
        if s is None:
            zero = torch.zeros((), device=logits.device)
            s = self._sums[layer] = _LayerSums(torch.zeros(e, device=logits.device), zero, zero.clone())
        s.tokens_per_expert += expert_counts(topk_ids, e)
        s.aux_loss += switch_load_balancing_loss(probs, topk_ids)
        s.z_loss += router_z_loss(logits)
        s.forwards += 1

    def has_data(self) -> bool:
        return any(s.forwards for s in self._sums.values())

    def reset(self) -> None:
        self._sums.clear()

    def summary(self, per_expert: bool = True, prefix: str = "moe") -> dict[str, float]:
        """Plain floats for loggers: per layer ``{prefix}/layer{i}/aux_loss`` and ``z_loss`` (means over the
        recorded forwards; Switch convention, balanced = 1.0), ``overload`` (max / mean tokens per expert) and,
        with ``per_expert``, ``expert_{e}_tokens`` (assignment counts); plus ``{prefix}/aux_loss`` and
        ``{prefix}/z_loss`` averaged over layers."""
        out: dict[str, float] = {}
        layers = [(layer, s) for layer, s in sorted(self._sums.items()) if s.forwards]
        for layer, s in layers:
            counts = s.tokens_per_expert.tolist()
            p = f"{prefix}/layer{layer}"  # the trainer's names (moe/layerL/<stat>, docs/routing-health.md)
            out[f"{p}/aux_loss"], out[f"{p}/z_loss"] = float(s.aux_loss) / s.forwards, float(s.z_loss) / s.forwards
            mean = sum(counts) / len(counts)
            out[f"{p}/overload"] = max(counts) / mean if mean > 0 else 0.0
            if per_expert:
                out.update({f"{p}/expert_{e}_tokens": c for e, c in enumerate(counts)})
        for stat in ("aux_loss", "z_loss") if layers else ():
            out[f"{prefix}/{stat}"] = sum(out[f"{prefix}/layer{layer}/{stat}"] for layer, _ in layers) / len(layers)
        return out


class AcceleratedMoeBlock(nn.Module):
    """Drop-in replacement of one transformers sparse MoE block: same submodules, moetrain's expert computation.

    Args:
        block: the HF block (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``,
            ``OlmoeSparseMoeBlock``, ``Dots1MoE`` or ``DeepseekV3MoE``).
        layer: its decoder layer index (for the statistics).
        stats: where training-mode forwards record their routing.
        backend: ``grouped_mm`` or ``loop`` (moetrain's reference).
    """

    def __init__(self, block: nn.Module, layer: int, stats: HFRoutingSums, backend: str = "grouped_mm"):
        super().__init__()
        self.score_func, shared, gated = SUPPORTED_BLOCKS[type(block).__name__]
        self.layer = layer
        # The HF block's submodules (nn.Module.__getattr__ types them Tensor | Module): its router, its experts.
        self.gate = cast(nn.Module, block.gate)
        self.experts = cast(nn.Module, block.experts)
        self.shared_name = shared
        if shared is not None:
            self.add_module(shared, getattr(block, shared))
        self.shared_expert_gate = cast(nn.Module, block.shared_expert_gate) if gated else None
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.num_experts = self._expert_weights()[0].shape[0]
        self._dispatcher = LocalDispatcher(self.num_experts)
        self._expert_fn = BACKENDS[backend].experts
        self._stats = stats

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [B, S, D] -> [B, S, D], the HF block's output."""
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # Mixtral's input jitter, same RNG draw as transformers
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.reshape(-1, shape[-1])  # [T, D]
        # The HF router decides (its hooks record router_logits for output_router_logits=True).
        router_logits, topk_weights, topk_ids = self.gate(x)  # [T, E], [T, K], [T, K]
        rows, tokens_per_expert, meta = self._dispatcher.dispatch(x, topk_ids, topk_weights)
        gate_up, down = self._expert_weights()
        y = self._expert_fn(rows, gate_up, down, tokens_per_expert, "swiglu")
        out = self._dispatcher.combine(y, meta).to(x.dtype)  # [T, D]
        if self.shared_name is not None:
            out = out + shared_output(getattr(self, self.shared_name), self.shared_expert_gate, x)
        if self.training:
            self._stats.record(self.layer, router_logits, topk_ids, self.score_func)
        return out.reshape(shape)

    def _expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The HF experts' ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F] (its parameters, as they are now)."""
        return cast(torch.Tensor, self.experts.gate_up_proj), cast(torch.Tensor, self.experts.down_proj)


def accelerate(model: nn.Module, backend: str = "grouped_mm") -> HFRoutingSums:
    """Swap every supported sparse MoE block of ``model`` in place for :class:`AcceleratedMoeBlock`.

    Parameters are shared, not copied: an optimizer built before or after the swap, ``state_dict()`` and
    ``save_pretrained`` see the same tensors under the same names. Loss, logits and gradients equal the
    unmodified model's up to float summation order (fp32: ~1e-7).

    Args:
        model: a transformers model (``*ForCausalLM`` or its base model).
        backend: ``grouped_mm`` (fast path) or ``loop`` (reference).
    Returns:
        The :class:`HFRoutingSums` the swapped blocks record into (give it to :class:`MoELoggingCallback`).
    Raises:
        ConfigError: an unknown backend, a model with no supported MoE block, or experts that are not SwiGLU.
    """
    if backend not in _EXPERT_BACKENDS:
        raise ConfigError(f"backend: unknown backend {backend!r}; choose one of {sorted(_EXPERT_BACKENDS)}")
    act = getattr(getattr(model, "config", None), "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r}: moetrain's experts are SwiGLU (silu)")
    stats = HFRoutingSums()
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in SUPPORTED_BLOCKS]
    if not targets:
        found = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()})
        raise ConfigError(f"{type(model).__name__}: no supported sparse MoE block (supported: "
                          f"{sorted(SUPPORTED_BLOCKS)}; found {found or 'none'})")
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = next((int(p) for p in reversed(name.split(".")) if p.isdigit()), len(stats.layers))
        setattr(parent, child, AcceleratedMoeBlock(block, layer, stats, backend))
        stats.layers.append(layer)
    return stats


# transformers' TrainerCallback, resolved at import time (a clear error without the hf extra): mypy cannot follow it.
class MoELoggingCallback(transformers_module().TrainerCallback):  # type: ignore[misc]
    """A ``transformers.TrainerCallback`` that adds the routing statistics of :func:`accelerate`'s blocks to every
    training log (see :meth:`HFRoutingSums.summary` for the keys), then resets them, so each log covers the steps
    since the previous one.

    Values are added to the ``logs`` dict the Trainer hands to its callbacks and to ``state.log_history``; the
    reporting integrations (TensorBoard, W&B, ...) see them when this callback runs before them: add it with
    :func:`add_moe_logging`, which puts it first.

    Args:
        stats: what :func:`accelerate` returned.
        per_expert: also log each expert's token count (E values per layer).
    """

    def __init__(self, stats: HFRoutingSums, per_expert: bool = True):
        self.stats, self.per_expert = stats, per_expert

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self.stats.has_data():
            return
        values = self.stats.summary(self.per_expert)
        self.stats.reset()
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)


def add_moe_logging(trainer, stats: HFRoutingSums, per_expert: bool = True) -> MoELoggingCallback:
    """Create a :class:`MoELoggingCallback` and put it first among ``trainer``'s callbacks (so that the loggers,
    which are callbacks too, receive its values). Returns the callback."""
    callback = MoELoggingCallback(stats, per_expert)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
