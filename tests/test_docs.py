"""The documentation's promises that can be checked without building the site (CI builds it: `mkdocs build --strict`).

- Every config field has a description in its class docstring: the configuration reference (docs/configuration.md)
  is generated from those descriptions by docs/hooks/config_tables.py, which fails the strict build otherwise.
- The README keeps the two set-up commands, unchanged, first, and stays short.
"""

from __future__ import annotations

import dataclasses
import json
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP_COMMANDS = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && moetrain train",
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[test]' && "
    "python -m pytest -q",
]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hook():
    return _load("config_tables")


def test_field_docs_reads_single_combined_and_continued_entries():
    @dataclasses.dataclass
    class Toy:
        """Summary.

        Fields (first group):
            alpha: the first
                field, continued.
            beta / gamma: two fields
                that share a text.

        Fields (second group):
            delta (int): with a type.
        """

        alpha: int = 0
        beta: int = 0
        gamma: int = 0
        delta: int = 0

    docs = _hook().field_docs(Toy)
    assert docs == {
        "alpha": "the first field, continued.",
        "beta": "two fields that share a text.",
        "gamma": "two fields that share a text.",
        "delta": "with a type.",
    }


def test_field_docs_misses_an_undocumented_field():
    @dataclasses.dataclass
    class Toy:
        """Summary mentioning ``hidden_field`` in prose only.

        Fields:
            shown: documented.
        """

        shown: int = 0
        hidden_field: int = 0

    assert "hidden_field" not in _hook().field_docs(Toy)


def test_every_config_field_has_a_description():
    from moetrain.config import Config

    hook = _hook()
    missing = []
    paths = []
    for path, cls in hook.sections(Config):
        docs = hook.field_docs(cls)
        nested = hook._nested(cls)
        for f in dataclasses.fields(cls):
            full = f"{path}.{f.name}" if path else f.name
            paths.append(full)
            if path and f.name not in nested and f.name not in docs:
                missing.append(f"{full} ({cls.__module__}.{cls.__qualname__})")
    assert "model.moe.top_k" in paths and "train.lr" in paths  # the walk reaches nested sections
    assert not missing, "config fields without a description in their class docstring: " + ", ".join(missing)


def test_config_reference_renders_every_section():
    from moetrain.config import Config

    hook = _hook()
    text = hook.render_reference()
    for path, _ in hook.sections(Config):
        if path:
            assert f"### {path}\n" in text


def test_readme_starts_with_the_two_setup_commands_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert blocks[:2] == SETUP_COMMANDS
    assert readme.index(SETUP_COMMANDS[0]) < readme.index("\n## ")  # before any section
    assert len(readme.splitlines()) < 120


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_pages_link_only_to_existing_pages(page):
    """A quick local version of the strict build's link check (relative .md links only)."""
    text = (ROOT / "docs" / page).read_text()
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / "docs" / target).resolve().is_file(), f"{page} links to missing {target}"


def test_griffe_extension_separates_sections_written_without_blank_lines():
    pytest.importorskip("griffe")  # the docs extra
    ext = _load("griffe_docstrings")
    text = "Summary.\n\nArgs:\n    x: [T, D].\nReturns:\n    y.\nRaises:\n    ValueError: bad x.\nFields (router):\n    a: b."
    fixed = ext.separate_sections(text)
    assert fixed == ("Summary.\n\nArgs:\n    x: [T, D].\n\nReturns:\n    y.\n\nRaises:\n    ValueError: bad x.\n"
                     "Fields (router):\n    a: b.")  # only griffe's own section titles move
    import griffe

    kinds = [s.kind.value for s in griffe.Docstring(fixed, parser=griffe.Parser.google).parse()]
    assert kinds[-3:-1] == ["returns", "raises"]


def test_griffe_extension_links_sphinx_roles_through_the_module_scope():
    griffe = pytest.importorskip("griffe")
    ext = _load("griffe_docstrings")
    pkg = griffe.load("moetrain", search_paths=[str(ROOT / "src")], resolve_aliases=False)
    layer = pkg["moe.layer"]
    text = ext.link_roles("a :class:`MoEConfig`, a :func:`~moetrain.moe.capacity.expert_capacity` and "
                          ":func:`no_such_name`", layer)
    assert '<autoref identifier="moetrain.moe.config.MoEConfig" optional><code>MoEConfig</code></autoref>' in text
    assert ('<autoref identifier="moetrain.moe.capacity.expert_capacity" optional><code>expert_capacity</code>'
            "</autoref>") in text
    assert text.endswith("and <code>no_such_name</code>")


def test_results_page_is_rendered_from_every_record():
    """docs/results.md is what `python -m moetrain.results` renders from results/*.json (rerun it after adding a
    record), and every record's title, date, CPU, commit and figures appear on it."""
    from moetrain import results

    records = results.load(ROOT / "results")
    assert records, "results/ holds no records"
    page = (ROOT / "docs" / "results.md").read_text()
    assert page == results.render(records), "docs/results.md is out of date: run python -m moetrain.results"
    for path in sorted((ROOT / "results").glob("*.json")):
        raw = json.loads(path.read_text())
        assert f"`results/{path.name}`" in page
        for key in ("title", "date", "cpu", "commit"):
            assert raw[key] in page, f"{path.name}: {key} missing from the page"
        for value in raw.get("figures", {}).values():
            assert f"| {results._cell(value)} |" in page


def test_results_renderer_accepts_any_section_and_extra_keys_and_names_bad_fields(tmp_path):
    from moetrain import results

    good = {"title": "t", "date": "2026-12-07", "cpu": "c", "commit": "abc1234", "command": "moetrain x",
            "section": "A new section", "gpu": "NVIDIA H100", "batch": 8,
            "table": [{"k": 1, "tokens/s": 2.5}, {"k": 2, "tokens/s": "a|b"}]}
    (tmp_path / "a.json").write_text(json.dumps(good))
    page = results.render(results.load(tmp_path))
    assert "## A new section" in page and "GPU: NVIDIA H100" in page and "batch: 8" in page
    assert "| k | tokens/s |" in page and "| 2 | a\\|b |" in page
    for bad, message in [({**good, "date": "7 Dec"}, "date='7 Dec'"),
                         ({k: v for k, v in good.items() if k != "cpu"}, "cpu=None"),
                         ({k: v for k, v in good.items() if k != "table"}, "neither 'figures' nor 'table'"),
                         ({**good, "table": {"columns": ["a", "b"], "rows": [[1]]}}, "table.rows[0]")]:
        (tmp_path / "a.json").write_text(json.dumps(bad))
        with pytest.raises(results.RecordError, match=re.escape(f"a.json: {message}")):
            results.load(tmp_path)


def test_write_record_fills_in_the_machine_and_never_overwrites(tmp_path):
    from moetrain import results

    record = {"title": "A bench, 2 threads", "command": "moetrain bench moe", "figures": {"ms": 1.5}}
    path = results.write_record(record, tmp_path, slug="bench")
    written = json.loads(path.read_text())
    assert path.name == f"{written['date']}-bench.json" and written["cpu"] and written["commit"]
    with pytest.raises(FileExistsError):
        results.write_record(record, tmp_path, slug="bench")
    again = [results.write_record(record, tmp_path, slug="bench", numbered=True) for _ in range(2)]  # a rerun
    assert [p.name for p in again] == [f"{written['date']}-bench-2.json", f"{written['date']}-bench-3.json"]
    assert path.read_text() == json.dumps(written, indent=2) + "\n"  # the first record untouched


HISTORY_TAG = re.compile(r"\b(wave|issue) [0-9]|\b[0-9a-f]{7} ?\)", re.I)


@pytest.mark.parametrize("page", ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")
                                                      if p.name != "results.md"))
def test_docs_describe_the_product_without_history_tags(page):
    """History (development rounds, issue numbers, commits) lives in CHANGELOG.md, git log and the results records
    (results.md shows each record's commit by design); the README and the documentation describe the product."""
    lines = (ROOT / page).read_text().splitlines()
    tagged = [f"{page}:{i}: {line.strip()[:100]}" for i, line in enumerate(lines, 1) if HISTORY_TAG.search(line)]
    assert not tagged, "history tags in the docs:\n" + "\n".join(tagged)
