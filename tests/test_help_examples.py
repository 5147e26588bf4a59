"""Every example in the help texts works: the command lines they show (an epilog line or a `quoted` command) parse,
and the cheap ones run (``train`` examples as ``--dry-run``, ``--list-fields`` as is); the ``e.g.`` fragments of an
argument's help parse as that argument (FIELD=VALUE examples build a valid config; compare's variants resolve, and
its dense variant is the preset's dense twin as the help says)."""

from __future__ import annotations

import argparse
import re

import pytest

from moetrain.cli import build_parser, main, parse_args

# Placeholders the help texts use for what the user supplies.
PLACEHOLDERS = {"NAME": "tiny", "N": "2", "PRESET": "tiny"}
_QUOTED = re.compile(r"`(moetrain [^`]+)`")
_EG = re.compile(r"e\.g\.\s+(.+?)(?:\s+\(|;|$)")


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of the whole tree: moetrain, moetrain train, moetrain bench moe, ..."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    """The full command lines shown in a parser's description, epilog and argument help."""
    texts = [parser.description or "", *(a.help or "" for a in parser._actions)]
    found = [m.group(1) for t in texts for m in _QUOTED.finditer(" ".join(t.split()))]
    for line in (parser.epilog or "").splitlines():
        stripped = line.strip()
        found += _QUOTED.findall(stripped) or ([stripped] if stripped.startswith("moetrain ") else [])
    return found


def _argv(command: str, tmp_path) -> list[str]:
    words = [PLACEHOLDERS.get(w, w) for w in command.split()[1:]]
    if "FILE" in words:  # a config file the example reads
        config = tmp_path / "run.json"
        config.write_text('{"preset": "tiny"}')
        words = [str(config) if w == "FILE" else w for w in words]
    return words


TREE = list(_parsers(build_parser()))
EXAMPLES = [(" ".join(path), cmd) for path, p in TREE for cmd in _commands(p)]


def test_the_help_texts_have_examples():
    assert len(EXAMPLES) >= 4, EXAMPLES
    assert any(cmd.startswith("moetrain train --preset tiny") for _, cmd in EXAMPLES), EXAMPLES


@pytest.mark.parametrize("where, command", EXAMPLES)
def test_command_examples_parse_and_the_cheap_ones_run(where, command, tmp_path, capsys):
    argv = _argv(command, tmp_path)
    sub = [p for path, p in TREE if list(path) == argv[:len(path)] and path]
    parser = max(sub, key=lambda p: len(p.prog))  # the deepest command the example names
    required = [a for a in parser._actions if not a.option_strings and a.required and a.nargs is None]
    if argv[0] == "train":
        if "--list-fields" not in argv:
            argv = [*argv, "--dry-run"]  # validates the config and its layout; trains nothing
        assert main(argv) == 0, (where, command, capsys.readouterr().err)
        return
    if required:  # a fragment such as `moetrain placement --ep N`: its options must be the command's own
        options = {o for a in parser._actions for o in a.option_strings}
        assert all(w in options for w in argv if w.startswith("-")), (where, command)
        return
    parse_args(argv)


def _fragments():
    """(command path, action, text after "e.g.") of every argument help with an example."""
    for path, p in TREE:
        for a in p._actions:
            for m in _EG.finditer(" ".join((a.help or "").split())):
                yield path, a, m.group(1)


FRAGMENTS = list(_fragments())


def test_argument_examples_are_found():
    dests = {(path, a.dest) for path, a, _ in FRAGMENTS}
    assert {(("train",), "overrides"), (("compare",), "variants"), (("plan",), "overrides")} <= dests, dests


@pytest.mark.parametrize("path, action, text", FRAGMENTS, ids=[f"{' '.join(p)}:{a.dest}" for p, a, _ in FRAGMENTS])
def test_argument_examples_parse(path, action, text, tmp_path):
    from moetrain.config import build_config
    from moetrain.configlib import parse_overrides

    if action.dest == "overrides":  # FIELD=VALUE examples build a valid config
        build_config(None, None, parse_overrides(text.split()))
        return
    if action.dest == "variants":
        _check_compare_variants(text.split())
        return
    if text.startswith("-"):  # options of this command: "--a 1 --b 2" up to the first word that is neither
        words = text.split()
        n = 0
        while n + 1 < len(words) and words[n].startswith("-"):
            n += 2
        args = parse_args([*path, *words[:n]])
        if path == ("bench", "train") and "twin" in text:  # same active expert width K * F as the preset
            from moetrain.config import build_config

            m = build_config(args.preset).model.moe
            assert args.top_k * args.expert_ffn == m.top_k * m.experts.ffn_hidden, text
        return
    values = [v.strip() for v in re.split(r",\s+|\s+or\s+", text)]
    if action.option_strings:
        dummies = []  # what the command requires besides the option: a path per positional, 2 per option
        for a in dict(TREE)[path]._actions:
            if a.required and a is not action:
                dummies += [a.option_strings[0], "2"] if a.option_strings else [str(tmp_path / a.dest)]
        for value in values:  # the value parses as the option's (its type and choices)
            parse_args([*path, *dummies, action.option_strings[-1], value])
    else:
        pytest.fail(f"{' '.join(path)} {action.dest}: an example of a positional argument nobody checks: {text}")


def _check_compare_variants(specs: list[str]) -> None:
    """Each variant resolves over the default preset; a ``model.moe_every=0`` variant is the preset's dense twin:
    its parameters are the MoE's active ones less the routers' (the FFN is as wide as the active experts)."""
    from moetrain.commands.compare import count_params, parse_variant, resolve

    configs = {v.name: resolve(v, None, {}, {}) for v in map(parse_variant, specs)}
    assert len(configs) == len(specs)
    dense = [c for c in configs.values() if c.model.moe_every == 0]
    moe = [c for c in configs.values() if c.model.moe_every != 0]
    for d in dense:
        for m in moe:
            routers = m.model.moe.num_experts * m.model.hidden * len(m.model.moe_layer_indices)
            assert count_params(d)[0] == count_params(m)[1] - routers
