"""MkDocs hook: renders the configuration reference from the config dataclasses themselves, so it cannot drift.

A page line ``<!-- config-reference -->`` becomes one section per config dataclass reachable from
:class:`moetrain.config.Config` (``model``, ``model.moe``, ``model.moe.router``, ...): its field path, type,
default and the field's description taken from the class docstring's ``Fields:`` / ``Attributes:`` entries
(``name: text`` or ``a / b / c: text``; read by :mod:`moetrain.config_docs`). A field without a description is a
warning, so ``mkdocs build --strict`` fails until it is documented. ``<!-- config-renames -->`` becomes the table of
old field paths that still load (``moetrain.config.LEGACY_PATHS``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import re
from typing import Any

# The descriptions and the walk over the sections are the package's, shared with `moetrain train --list-fields`.
from moetrain.config_docs import field_docs, field_types, sections
from moetrain.config_docs import nested_configs as _nested

log = logging.getLogger("mkdocs.hooks.config_tables")  # under "mkdocs": counted by --strict

REFERENCE = "<!-- config-reference -->"
RENAMES = "<!-- config-renames -->"

def _inline(text: str) -> str:
    """Docstring markup (reST roles, double backticks) as Markdown that is safe inside a table cell."""
    text = re.sub(r":(?:class|func|meth|attr|data|mod|obj|exc):`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`"
                  if m.group(0).count("~") else f"`{m.group(1)}`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


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
        kinds = field_types(cls)
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
            rows.append(f"| `{full}` | {_inline(kinds[f.name])} | {_default(f)} | {_inline(text)} |")
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

