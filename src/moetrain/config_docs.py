"""Every config field's path, type and description, read from the config dataclasses themselves.

A field's description is its entry in its class docstring's ``Fields:`` / ``Attributes:`` section (``name: text``
or ``a / b / c: text``, continued on deeper-indented lines). Two readers: ``moetrain train --list-fields``
(:func:`field_lines`) and the configuration reference of the documentation (docs/hooks/config_tables.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import re
import types
import typing
from typing import Any

from moetrain.configlib import format_value

_ENTRY = re.compile(r"^(?P<names>[A-Za-z_][A-Za-z0-9_]*(?:\s*/\s*[A-Za-z_][A-Za-z0-9_]*)*)"  # name or a / b / c
                    r"(?:\s*\([^)]*\))?:\s*(?P<text>.*)$")  # an optional (type), then the text
_SECTION = re.compile(r"^(Fields|Attributes)\b[^:]*:\s*$")
# The end of a description's first sentence: a full stop before a space, not the one of an abbreviation.
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)(?<!\beq)(?<!\bsec)(?<!\bal)(?<!\bcf)\.\s")


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: description}`` from the ``Fields...:`` / ``Attributes:`` sections of ``cls``'s docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    out: dict[str, str] = {}
    in_section, entry_indent, current = False, None, None
    for line in doc.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if _SECTION.match(stripped) and indent == 0:
            in_section, entry_indent, current = True, None, None
            continue
        if not in_section or not stripped:
            continue
        if indent == 0:  # the section ended
            in_section, current = False, None
            continue
        if entry_indent is None:
            entry_indent = indent
        m = _ENTRY.match(stripped) if indent == entry_indent else None
        if m:
            current = [n.strip() for n in m.group("names").split("/")]
            for name in current:
                out[name] = m.group("text")
        elif current is not None and indent > entry_indent:
            for name in current:
                out[name] += " " + stripped
    return out


def nested_configs(cls: type) -> dict[str, type]:
    """Fields of ``cls`` whose value is itself a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: tp for f in dataclasses.fields(cls)
            if isinstance(tp := hints.get(f.name), type) and dataclasses.is_dataclass(tp)}


def sections(cls: type, path: str = "") -> list[tuple[str, type]]:
    """``[(field path, dataclass)]`` depth-first from ``cls`` (the root has path "")."""
    out = [(path, cls)]
    for name, sub in nested_configs(cls).items():
        out += sections(sub, f"{path}.{name}" if path else name)
    return out


def summary(text: str) -> str:
    """The first sentence of a description as plain text in the config's words (reST roles and double backticks
    removed, Python's ``None`` as ``null``)."""
    text = re.sub(r":(?:class|func|meth|attr|data|mod|obj|exc):`~?([^`]+)`", r"\1", text).replace("``", "")
    text = re.sub(r"\bNone\b", "null", text)
    end = _SENTENCE_END.search(text)
    return text[:end.start() + 1] if end else text


def field_types(cls: type) -> dict[str, str]:
    """``{field name: its type as a user writes values}`` for the fields of config dataclass ``cls``: ``int``,
    ``float or null``, ``one of windows / documents``, ``list, each one of dead_expert / collapse / ...``."""
    hints = typing.get_type_hints(cls)
    return {f.name: _type_text(hints[f.name]) for f in dataclasses.fields(cls)}


def _type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + " / ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        text = " or ".join(_type_text(a) for a in kinds)
        return text + " or null" if len(kinds) < len(args) else text
    if origin in (tuple, list):
        inner = _type_text(args[0]) if args else "any"
        return f"list, each {inner}" if inner.startswith("one of") else f"list of {inner}"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def field_lines(config: Any) -> list[str]:
    """One line per field of the sections of ``config`` (a :class:`moetrain.config.Config`; the root's ``preset``
    is not a section field): ``path = value  (type)  summary of its description``, the value as an override
    writes it (:func:`moetrain.configlib.format_value`), the description's :func:`summary`; in declaration order,
    sections depth-first."""
    rows = []
    for path, cls in sections(type(config)):
        if not path:
            continue
        section = operator.attrgetter(path)(config)
        docs, nested, kinds = field_docs(cls), nested_configs(cls), field_types(cls)
        for f in dataclasses.fields(cls):
            if f.name in nested or not f.init:
                continue
            rows.append((f"{path}.{f.name} = {format_value(getattr(section, f.name))}", kinds[f.name],
                         summary(docs.get(f.name, ""))))
    width = max(len(left) for left, _, _ in rows)
    return [f"{left:<{width}}  ({tp})  {text}".rstrip() for left, tp, text in rows]
