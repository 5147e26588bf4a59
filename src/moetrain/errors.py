"""User-facing errors.

Anything raised as a :class:`MoetrainError` is a problem with the user's input (a config value, a path, a
checkpoint), not a bug: the CLI prints its message on one line and exits with status 2, without a traceback
(``--debug`` shows it).
"""

from __future__ import annotations


class MoetrainError(Exception):
    """A problem with the user's input; the message names the field or file and what is wrong."""


class ConfigError(MoetrainError, ValueError):
    """An invalid configuration value. The message starts with the field path, e.g. ``model.moe.top_k``."""


class DataError(MoetrainError):
    """Unusable training data: a missing path, an empty corpus, a corpus shorter than one sequence."""


class CheckpointError(MoetrainError):
    """A checkpoint that cannot be used: missing, corrupt, or from a different model shape."""
