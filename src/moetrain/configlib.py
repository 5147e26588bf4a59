"""Typed, validated construction of the frozen config dataclasses from dicts, files and ``a.b=value`` overrides.

Every component config is a frozen, keyword-only dataclass that validates itself in ``__post_init__`` with
:func:`require`. :func:`from_dict` builds one from plain data, rejecting unknown keys (with a close-match
suggestion) and wrong types, and prefixes every error with the field path (``model.moe.top_k: ...``).
:func:`rename_legacy` moves fields given under an old path to their new one (with a note) before validation.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from moetrain.errors import ConfigError

T = TypeVar("T")


class FieldError(ConfigError):
    """Raised by a config's own validation; :func:`from_dict` prefixes ``field`` with the parent's path."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def require(condition: bool, field: str, message: str) -> None:
    """Raise :class:`FieldError` for ``field`` unless ``condition`` holds."""
    if not condition:
        raise FieldError(field, message)


def require_at_least(config: Any, minimum: float, *names: str, note: str = "") -> None:
    """Raise :class:`FieldError` for the first field of ``names`` on ``config`` below ``minimum``:
    ``NAME: must be >= MINIMUM (NOTE), got VALUE`` (the parenthesis only with a ``note``)."""
    for name in names:
        value = getattr(config, name)
        require(value >= minimum, name, f"must be >= {minimum}{f' ({note})' if note else ''}, got {value}")


# KB/MB/GB/TB decimal and KiB/MiB/GiB/TiB binary, as transformers reads ``max_shard_size``
# (``transformers.utils.hub.convert_file_size_to_int``); a bare K/M/G/T is binary (``64M``, as Docker and ``ls`` use).
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
               "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str, flag: str) -> int:
    """A byte count given to ``flag``: ``"5GB"`` (5 * 10**9), ``"500MB"``, ``"1.5GiB"`` or ``"1.5G"`` (1.5 * 2**30),
    ``"64M"`` (64 * 2**20), ``"1000000"`` (bytes); units are case-insensitive.

    Raises:
        ConfigError: anything else, or a size below one byte (the message names ``flag`` and the value).
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"{flag} {text!r}: not a byte count (e.g. 5GB = 5*10^9 bytes, 5GiB or 5G = 5*2^30 bytes, "
                          "or a number of bytes)")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise ConfigError(f"{flag} {text!r}: must be at least 1 byte")
    return size


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# A scalar field's type -> the Python types its value may have, and what an error says it expects.
_SCALARS: dict[Any, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "true or false"), int: ((int,), "an integer"), float: ((int, float), "a number"),
    str: ((str,), "a string")}


def _coerce(value: Any, tp: Any, path: str, legacy: Mapping[str, str] | None = None) -> Any:
    """Check (and minimally convert: int -> float) ``value`` against the annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path, legacy)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: unexpected value {format_value(value)}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value is None and "none" in choices:  # an override's `none` reads as null; here it is the choice 'none'
            return "none"
        if value not in choices:
            raise ConfigError(f"{path}: must be one of {list(choices)}, got {format_value(value)}")
        return value
    if origin in (tuple, list):
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and (items := _bare_list(value)) is not None:
            value = items  # an override's [a, b] (JSON would have given a list already)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {format_value(value)}")
        return tuple(_coerce(v, item_tp, f"{path}[{i}]", legacy) for i, v in enumerate(value))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table of fields, got {format_value(value)}")
        return from_dict(tp, value, path, legacy)
    if tp is Any:
        return value
    if tp not in _SCALARS:
        raise ConfigError(f"{path}: unsupported field type {getattr(tp, '__name__', tp)}")
    accepted, what = _SCALARS[tp]
    valid = isinstance(value, accepted) and (tp is bool or not isinstance(value, bool))  # bool is an int subclass
    if not valid:
        raise ConfigError(f"{path}: expected {what}, got {format_value(value)}")
    return float(value) if tp is float else value


def _field_types(cls: type, data: dict[str, Any], path: str, legacy: Mapping[str, str] | None) -> dict[str, Any]:
    """The types of ``cls``'s init fields, after refusing a key of ``data`` that is none of them
    (:func:`_unknown_key`)."""
    hints = typing.get_type_hints(cls)
    types_ = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in types_:
            raise _unknown_key(key, path, list(types_), legacy)
    return types_


def _unknown_key(key: str, path: str, known: list[str], legacy: Mapping[str, str] | None) -> ConfigError:
    """The error for ``key`` under ``path``: the closest known field, or the new path of a close old field name."""
    candidates = {name: _join(path, name) for name in known}
    for old, new in (legacy or {}).items():
        parent, _, name = old.rpartition(".")
        if parent == path:
            candidates.setdefault(name, new)
    close = difflib.get_close_matches(key, list(candidates), n=1)
    hint = f"; did you mean '{candidates[close[0]]}'?" if close else f"; known fields: {sorted(known)}"
    return ConfigError(f"{_join(path, key)}: unknown config key{hint}")


def from_dict(cls: type[T], data: dict[str, Any], path: str = "", legacy: Mapping[str, str] | None = None) -> T:
    """Build the config dataclass ``cls`` from ``data``.

    Args:
        cls: a frozen config dataclass; nested dataclass fields are built from nested dicts.
        data: plain data (``{"moe": {"top_k": 1}}``).
        path: the field path of ``cls`` in the whole config (``"model"``), for messages.
        legacy: old full field path -> new one (see :func:`rename_legacy`); used only to suggest the new path
            for a mistyped or old key.
    Raises:
        ConfigError: an unknown key (with a close-match suggestion), a value of the wrong type, or a value the
            config's own validation rejects; the message starts with the full field path.
    """
    types_ = _field_types(cls, data, path, legacy)
    kwargs = {k: _coerce(v, types_[k], _join(path, k), legacy) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ConfigError(f"{_join(path, e.field)}: {e.message}") from None


def check_types(cls: type, data: dict[str, Any], path: str = "", legacy: Mapping[str, str] | None = None) -> None:
    """Check the keys and value types of one source of config data (a ``--config`` file, the ``FIELD=VALUE``
    overrides) against the config dataclass ``cls`` before the sources are merged, so that a value a later source
    or a flag replaces is still refused when it could never be valid (``train.steps=1.5`` beside ``--steps 2``).
    Values are not checked against each other: that is :func:`from_dict`'s, on the merged data.

    Raises:
        ConfigError: an unknown key or a value of the wrong type; the message starts with the full field path.
    """
    types_ = _field_types(cls, data, path, legacy)
    for key, value in data.items():
        tp = types_[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(value, dict):
            check_types(tp, value, _join(path, key), legacy)
        else:
            _coerce(value, tp, _join(path, key), legacy)


_MISSING = object()


def _pop_path(data: dict[str, Any], parts: list[str]) -> Any:
    """Remove and return the value at ``parts`` (``_MISSING`` when absent); emptied parent tables stay."""
    node: Any = data
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or parts[-1] not in node:
        return _MISSING
    return node.pop(parts[-1])


def print_note(message: str) -> None:
    """Print a one-line note to stderr (the default sink of :func:`rename_legacy`)."""
    print(message, file=sys.stderr)


def rename_legacy(data: dict[str, Any], legacy: Mapping[str, str],
                  note: Callable[[str], None] = print_note) -> dict[str, Any]:
    """Move every value given under an old field path of ``legacy`` to its new path, saying so once per field.

    Applied to raw config data (a ``--config`` file, ``FIELD=VALUE`` overrides, a run's saved ``config.json``)
    before it is merged with other sources and validated, so files and commands written for the old layout keep
    working. Values are moved unchanged.

    Args:
        data: nested plain data; not modified.
        legacy: old full path -> new full path (``"model.moe.capacity_factor" -> "model.moe.capacity.factor"``).
        note: receives one line per moved field: ``note: OLD is now NEW`` (default: printed to stderr).
    Returns:
        A copy of ``data`` with only new paths.
    Raises:
        ConfigError: a field given under both its old and its new path with different values, or an old path
            whose new parent is not a table.
    """
    out = copy.deepcopy(data)
    for old, new in legacy.items():
        value = _pop_path(out, old.split("."))
        if value is _MISSING:
            continue
        note(f"note: {old} is now {new}")
        *parents, name = new.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{new}: cannot move the old field {old} here: '{part}' is not a table")
        if name in node and node[name] != value:
            raise ConfigError(f"{new}: given both as {new}={node[name]!r} and under its old name {old}={value!r}; "
                              f"keep {new}")
        node[name] = value
    return out


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain JSON-able data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: values in ``update`` win; nested tables merge."""
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def format_value(value: Any) -> str:
    """``value`` (plain config data, as :func:`to_dict` gives) spelled as a config file or a ``FIELD=VALUE`` override
    writes it, for messages: ``null``, ``true`` / ``false``, numbers as Python prints them (``0.003``), strings
    quoted as every :class:`ConfigError` quotes them (``'bf16'``), lists item by item (``[1, null]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return repr(value)


def _parse_scalar(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _bare_list(text: str) -> list[Any] | None:
    """``[a, b]`` (a list without JSON's quotes, as a shell leaves ``['a', 'b']``) -> ``["a", "b"]``; else None."""
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return None
    inner = stripped[1:-1].strip()
    return [_parse_scalar(item.strip().strip("'\"")) for item in inner.split(",")] if inner else []


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["model.moe.top_k=1", "train.lr=3e-3"]`` -> nested dict.

    Values: ``true`` / ``false``, ``null`` (or ``none``), JSON (numbers, ``["a", "b"]``), else the text as a string
    (a field that expects a list also takes ``[a, b]``, what a shell leaves of ``['a', 'b']``: :func:`_coerce`).

    Raises:
        ConfigError: an item without ``=``, or with an empty field name (``=3``, ``model..top_k=1``).
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected FIELD=VALUE, e.g. model.moe.top_k=1")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        if not all(part.strip() for part in parts):
            raise ConfigError(f"override '{item}': empty field name before '='; expected FIELD=VALUE, "
                              "e.g. model.moe.top_k=1")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is set both as a value and as a table")
        node[parts[-1]] = _parse_scalar(raw)
    return out


def load_file(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """Read a ``.toml`` or ``.json`` file of fields (a config file; ``plan --device``'s hardware file) into a dict.

    Raises:
        ConfigError: missing file, unknown suffix, or a syntax error (naming ``flag`` and the file).
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {p}: is a directory; expected a .toml or .json file")
    if not p.is_file():
        raise ConfigError(f"{flag} {p}: no such file")
    try:
        if p.suffix == ".toml":
            return tomllib.loads(p.read_text())
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            if not isinstance(data, dict):
                raise ConfigError(f"{flag} {p}: expected a JSON object of fields, got {type(data).__name__}")
            return data
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {p}: cannot parse: {e}") from None
    raise ConfigError(f"{flag} {p}: expected a .toml or .json file")
