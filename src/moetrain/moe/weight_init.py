"""The MoE modules' own initialisation, and deferring it to the model that owns them.

A :class:`~moetrain.moe.layer.MoELayer` (its :class:`~moetrain.moe.router.TopKRouter` and
:class:`~moetrain.moe.experts.RoutedExperts`) built on its own is ready to use: its weights are drawn from
Normal(0, :data:`DEFAULT_STD`) when it is built, as ``nn.Linear`` initialises itself. Inside
:class:`~moetrain.model.transformer.MoETransformer` they are not: the model draws every tensor afterwards, in one
order, from the global RNG (``MoETransformer.reset_parameters``), so drawing them twice would only change which
numbers a seed gives. The model builds its blocks inside :func:`deferred_init` (transformers' ``no_init_weights``
does the same for ``from_pretrained``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

DEFAULT_STD = 0.02  # ModelConfig.init_std's default (GPT-2, Mixtral's initializer_range)

_deferred: ContextVar[bool] = ContextVar("moetrain_deferred_init", default=False)


@contextmanager
def deferred_init() -> Iterator[None]:
    """MoE modules built inside leave their weights uninitialised (``torch.empty``) for their owner to draw."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def initialise_now() -> bool:
    """Whether a module being built should draw its own weights (outside :func:`deferred_init`)."""
    return not _deferred.get()
