"""MkDocs hook: renders the configuration reference from the config dataclasses themselves, so it cannot drift.

A page line ``<!-- config-reference -->`` becomes one section per config dataclass reachable from
:class:`moetrain.config.Config` (``model``, ``model.moe``, ``model.moe.router``, ...): its field path, type,
default and the field's description taken from the class docstring's ``Fields:`` / ``Attributes:`` entries
(``name: text`` or ``a / b / c: text``). A field without a description is a warning, so ``mkdocs build --strict``
fails until it is documented. ``<!-- config-renames -->`` becomes the table of old field paths that still load
(``moetrain.config.LEGACY_PATHS``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import re
import typing
from typing import Any

log = logging.getLogger("mkdocs.hooks.config_tables")  # under "mkdocs": counted by --strict

REFERENCE = "<!-- config-reference -->"
RENAMES = "<!-- config-renames -->"

_ENTRY = re.compile(r"^(?P<names>[A-Za-z_][A-Za-z0-9_]*(?:\s*/\s*[A-Za-z_][A-Za-z0-9_]*)*)(?:\s*\([^)]*\))?:\s*(?P<text>.*)$")
_SECTION = re.compile(r"^(Fields|Attributes)\b[^:]*:\s*$")


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
        if not in_section:
            continue
        if not stripped:
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


def _inline(text: str) -> str:
    """Docstring markup (reST roles, double backticks) as Markdown that is safe inside a table cell."""
    text = re.sub(r":(?:class|func|meth|attr|data|mod|obj|exc):`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`"
                  if m.group(0).count("~") else f"`{m.group(1)}`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def _type_name(tp: Any) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", None) or repr(tp)
    text = str(text).replace("typing.", "")
    return text.replace("|", "\\|")


def _nested(cls: type) -> dict[str, type]:
    """Fields of ``cls`` whose value is itself a config dataclass."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: fall back to the default factories
        hints = {}
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out[f.name] = tp
        elif f.default_factory is not dataclasses.MISSING and isinstance(f.default_factory, type) \
                and dataclasses.is_dataclass(f.default_factory):
            out[f.name] = f.default_factory
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`".replace("|", "\\|")


def sections(cls: type, path: str = "") -> list[tuple[str, type]]:
    """``[(field path, dataclass)]`` depth-first from ``cls`` (the root has path "")."""
    out = [(path, cls)]
    for name, sub in _nested(cls).items():
        out += sections(sub, f"{path}.{name}" if path else name)
    return out


def render_reference() -> str:
    from moetrain.config import Config

    parts = []
    for path, cls in sections(Config):
        if not path:
            continue
        docs = field_docs(cls)
        summary = _inline(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " "))
        nested = _nested(cls)
        rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
        hints = getattr(cls, "__annotations__", {})
        for f in dataclasses.fields(cls):
            full = f"{path}.{f.name}"
            if f.name in nested:
                anchor = _slug(full)
                rows.append(f"| `{full}` | section | | see [{full}](#{anchor}) |")
                continue
            text = docs.get(f.name)
            if text is None:
                log.warning("config reference: %s.%s (%s) has no description in its class docstring's Fields "
                            "section", cls.__module__, cls.__qualname__, full)
                text = ""
            rows.append(f"| `{full}` | `{_type_name(hints.get(f.name, f.type))}` | {_default(f)} | {_inline(text)} |")
        parts.append(f"### {path}\n\n`{cls.__module__}.{cls.__qualname__}`: {summary}\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def _slug(text: str) -> str:
    """The id Python-Markdown's toc extension gives a heading with this text."""
    return re.sub(r"[^\w\s-]", "", text).strip().lower().replace(" ", "-")


def render_renames() -> str:
    table = getattr(importlib.import_module("moetrain.config"), "LEGACY_PATHS", None)
    if not table:
        return "*(No field has been renamed.)*"
    rows = ["| old path (still loads, with a note) | new path |", "|---|---|"]
    for old, new in sorted(table.items()):
        rows.append(f"| `{old}` | `{new}` |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs hook signature)
    if REFERENCE in markdown:
        markdown = markdown.replace(REFERENCE, render_reference())
    if RENAMES in markdown:
        markdown = markdown.replace(RENAMES, render_renames())
    return markdown

