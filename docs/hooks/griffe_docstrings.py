"""Griffe extension (mkdocstrings): reads this project's docstring conventions the way its authors mean them.

Two conventions of the code base that griffe's Google-style parser does not follow on its own:

- Sections follow each other without a blank line (``Args:`` entries, then ``Returns:`` on the next line). Griffe
  starts a new section only after a blank line, so ``Returns:`` and ``Raises:`` were rendered as text inside the
  last argument's description. A blank line is inserted before each section title.
- Cross-references are written as Sphinx roles (:class:`~moetrain.moe.layer.MoELayer`). They become optional
  mkdocs-autorefs references: a link where the target is on an API page, plain code where it is not (a private
  helper, a module outside the reference), never a warning. ``~`` shows the last component only, as in Sphinx.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# Google-style section titles griffe knows (only those: other "Title:" lines stay text, e.g. "Fields (router):").
_SECTION = re.compile(r"^(Args|Arguments|Params|Parameters|Keyword Args|Keyword Arguments|Other Parameters|Returns|"
                      r"Return|Yields|Yield|Receives|Raises|Raise|Exceptions|Warns|Warnings|Attributes|Functions|"
                      r"Methods|Classes|Modules|Examples|Example|Note|Notes|Warning|Todo|See Also)\s*:\s*$")
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|obj|exc|const|type):`(~?)([^`<>]+)`")


def separate_sections(text: str) -> str:
    """``text`` with a blank line before every section title that follows a non-blank line."""
    out: list[str] = []
    for line in text.splitlines():
        if _SECTION.match(line) and out and out[-1].strip():
            out.append("")
        out.append(line)
    return "\n".join(out)


def _target(obj: griffe.Object, name: str) -> str | None:
    """The full path ``name`` means in ``obj``'s scope, or ``None``."""
    name = name.strip().lstrip(".")
    if name.startswith("moetrain."):
        return name
    head, _, rest = name.partition(".")
    scope: Any = obj
    while scope is not None:
        try:
            full = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError, ValueError, KeyError):
            full = None
        if full:
            return f"{full}.{rest}" if rest else full
        scope = scope.parent
    return None


def link_roles(text: str, obj: griffe.Object) -> str:
    """Sphinx roles in ``text`` as optional autorefs (see the module docstring)."""

    def replace(match: re.Match) -> str:
        tilde, name = match.group(1), match.group(2).strip()
        shown = name.rstrip("()").split(".")[-1] + ("()" if name.endswith("()") else "") if tilde else name
        target = _target(obj, name.rstrip("()"))
        code = f"<code>{shown}</code>"
        return f'<autoref identifier="{target}" optional>{code}</autoref>' if target else code

    return _ROLE.sub(replace, text)


class ProjectDocstrings(griffe.Extension):
    """Applies :func:`separate_sections` and :func:`link_roles` to every docstring once the tree is loaded."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:  # noqa: ARG002
        if obj.docstring is not None:
            obj.docstring.value = link_roles(separate_sections(obj.docstring.value), obj)
