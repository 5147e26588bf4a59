"""Chat messages -> one prompt string for ``/v1/chat/completions``.

A served directory with a chat template (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``, as transformers writes them) is rendered with it, the way transformers'
``apply_chat_template(messages, add_generation_prompt=True)`` renders it: Jinja2 in a sandbox, with ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``. Without one (a base model, e.g. a moetrain run) the
plain template :func:`plain_prompt` is used::

    System: You are terse.

    User: Hello!

    Assistant:
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


def plain_prompt(messages: list[dict[str, str]]) -> str:
    """``"Role: content"`` per message, separated by blank lines, then ``"Assistant:"`` for the reply (roles
    system and developer are written ``System``)."""
    turns = [f"{ROLE_NAMES[m['role']]}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template, or the plain one (``source == "plain"``).

    Attributes:
        source: the file it came from, or ``plain``.
        special_tokens: the rendered text carries the template's own special tokens (encode it without adding
            any); False for the plain template (encoded as a completion prompt is).
    """

    source: str
    template: Any = None  # a compiled jinja2 template
    bos_token: str = ""
    eos_token: str = ""

    @property
    def special_tokens(self) -> bool:
        return self.template is not None

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for ``messages`` (dicts with ``role`` and ``content``).

        Raises:
            ValueError: the template failed (its own ``raise_exception``, or an error in it), with its message.
        """
        if self.template is None:
            return plain_prompt(messages)
        try:
            return str(self.template.render(messages=messages, add_generation_prompt=True,
                                            bos_token=self.bos_token, eos_token=self.eos_token))
        except Exception as e:  # noqa: BLE001 - a template is user code: any error is the request's
            raise ValueError(f"the chat template ({self.source}) failed: {e}") from None


def _token_text(v: Any) -> str:
    """A tokenizer_config special token: a string or an AddedToken dict (``{"content": ...}``)."""
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return v if isinstance(v, str) else ""


def load_chat_template(root: str) -> ChatTemplate:
    """The chat template of served directory ``root``: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates: the one named ``default``), else the plain one.

    Raises:
        ValueError: the template does not compile (naming the file).
    """
    d = Path(root) if root else None
    cfg: dict[str, Any] = {}
    text, source = None, "plain"
    if d is not None and (d / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        except ValueError:
            cfg = {}
        raw = cfg.get("chat_template") if isinstance(cfg, dict) else None
        if isinstance(raw, list):
            raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(raw, str) and raw.strip():
            text, source = raw, str(d / "tokenizer_config.json")
    if d is not None and (d / "chat_template.jinja").is_file():
        text, source = (d / "chat_template.jinja").read_text(), str(d / "chat_template.jinja")
    if text is None:
        return ChatTemplate("plain")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(text)
    except TemplateError as e:
        raise ValueError(f"{source}: the chat template does not compile: {e}") from None
    cfg = cfg if isinstance(cfg, dict) else {}
    return ChatTemplate(source, compiled, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))
