"""Measured results as data: the JSON records in ``results/`` and the documentation page rendered from them.

A record is one measurement: ``title``, ``date`` (``YYYY-MM-DD``), ``cpu`` (the CPU model), ``commit``, ``command``
and its figures, as a ``figures`` dict (name -> number or string) and / or a ``table`` (``{"columns": [...],
"rows": [[...], ...]}``). The schema, with the optional keys, is ``results/README.md``.

``python -m moetrain.results`` writes ``docs/results.md`` from every ``results/*.json``; ``--check`` exits 1 when
that page differs from what the records render to. Plain Python and :mod:`json` only: no torch import.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REQUIRED = ("title", "date", "cpu", "commit", "command")
OPTIONAL = ("figures", "table", "section", "gpu", "torch", "notes", "source")
DEFAULT_SECTION = "Other"
# Sections in the order the page shows them; a section not listed comes after these, alphabetically.
SECTION_ORDER = ("MoE against its dense twin", "Training speed", "MoE layer speed", "CPU kernels", "Routing", "Data",
                 "BTA", "Checkpoints", "Serving", "Memory", "Scale-out",
                 "How the recipe was chosen")
PAGE_HEADER = """# Measured results

The measurements behind the documentation's figures, one per entry, each with the day, the machine, the commit and
the command that produced it. This page is generated from the JSON records in the repository's `results/` folder by
`python -m moetrain.results` (the record format: `results/README.md`); do not edit it by hand. Figures from
different machines or days are not comparable with each other: compare only figures within one entry.
"""


class RecordError(ValueError):
    """A results record that cannot be rendered; the message names the file and the key."""


def validate(record: Any, name: str) -> dict[str, Any]:
    """Check one record against the schema of ``results/README.md``.

    Args:
        record: the parsed JSON of one file.
        name: the file name, for error messages.

    Returns:
        the record as a dict with its table normalised to ``{"columns": [str, ...], "rows": [[...], ...]}``.

    Raises:
        RecordError: naming ``name`` and the key: a required key missing or empty, a date not ``YYYY-MM-DD``, no
            ``figures`` and no ``table``, a ``figures`` that is not an object, a table row of the wrong length.
    """
    if not isinstance(record, dict):
        raise RecordError(f"{name}: a record is a JSON object, got {type(record).__name__}")
    out = dict(record)
    for key in REQUIRED:
        value = out.get(key)
        if not isinstance(value, str) or not value.strip():
            raise RecordError(f"{name}: {key}={value!r}: a required key, a non-empty string")
    try:
        _dt.date.fromisoformat(out["date"])
    except ValueError:
        raise RecordError(f"{name}: date={out['date']!r}: expected YYYY-MM-DD") from None
    if "figures" not in out and "table" not in out:
        raise RecordError(f"{name}: neither 'figures' nor 'table': a record holds at least one of them")
    if "figures" in out and (not isinstance(out["figures"], dict) or not out["figures"]):
        raise RecordError(f"{name}: figures={out['figures']!r}: expected a non-empty object of name -> value")
    if "table" in out:
        out["table"] = _normalise_table(out["table"], name)
    return out


def _normalise_table(table: Any, name: str) -> dict[str, list[Any]]:
    if isinstance(table, list) and table and all(isinstance(row, dict) for row in table):
        columns: list[str] = []
        for row in table:
            columns += [str(k) for k in row if str(k) not in columns]
        return {"columns": columns, "rows": [[row.get(c, "") for c in columns] for row in table]}
    if not isinstance(table, dict) or not isinstance(table.get("columns"), list) or not isinstance(
            table.get("rows"), list):
        raise RecordError(f"{name}: table: expected {{\"columns\": [...], \"rows\": [[...], ...]}} or a list of "
                          f"objects, got {json.dumps(table)[:80]}")
    width = len(table["columns"])
    for i, row in enumerate(table["rows"]):
        if not isinstance(row, list) or len(row) != width:
            raise RecordError(f"{name}: table.rows[{i}]={json.dumps(row)[:80]}: expected a list of {width} values "
                              f"(one per column)")
    return {"columns": [str(c) for c in table["columns"]], "rows": table["rows"]}


def load(directory: Path) -> list[dict[str, Any]]:
    """Every record in ``directory`` (``*.json``, sorted by file name), validated; each gets a ``_file`` key.

    Raises:
        RecordError: a file that is not valid JSON or not a valid record (see :func:`validate`).
    """
    records = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RecordError(f"{path.name}: not valid JSON: {e}") from None
        record = validate(data, path.name)
        record["_file"] = path.name
        records.append(record)
    return records


def _cell(value: Any) -> str:
    plain = isinstance(value, (int, float, str)) and not isinstance(value, bool)
    return (str(value) if plain else json.dumps(value)).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """The lines of a markdown table (``|`` in a cell escaped, a newline a space)."""
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _section_key(section: str) -> tuple[int, str]:
    return (SECTION_ORDER.index(section), "") if section in SECTION_ORDER else (len(SECTION_ORDER), section)


def render(records: Sequence[Mapping[str, Any]]) -> str:
    """The results page (markdown): one section per ``section``, newest record first, each with its date, machine,
    commit, command, figures, table and notes. Every key of a record appears on the page."""
    sections: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        sections.setdefault(str(record.get("section") or DEFAULT_SECTION), []).append(record)
    out = [PAGE_HEADER]
    for section in sorted(sections, key=_section_key):
        out += [f"## {section}", ""]
        for r in sorted(sections[section], key=lambda r: (r["date"], r.get("_file", "")), reverse=True):
            out += [f"### {r['title']}", ""]
            meta = [f"**{r['date']}**", f"CPU: {r['cpu']}"]
            meta += [f"GPU: {r['gpu']}"] if r.get("gpu") else []
            meta += [f"commit `{r['commit']}`"] + ([f"torch {r['torch']}"] if r.get("torch") else [])
            extra = [k for k in r if k not in REQUIRED + OPTIONAL and not k.startswith("_")]
            meta += [f"{k}: {_cell(r[k])}" for k in extra]
            out += [" · ".join(meta), "", "```bash", str(r["command"]).rstrip(), "```", ""]
            if r.get("figures"):
                out += markdown_table(["figure", "value"], list(r["figures"].items())) + [""]
            if r.get("table"):
                out += markdown_table(r["table"]["columns"], r["table"]["rows"]) + [""]
            if r.get("notes"):
                out += [str(r["notes"]).strip(), ""]
            source = f"; first reported in {r['source']}" if r.get("source") else ""
            out += [f"*Record: `results/{r.get('_file', '?')}`{source}.*", ""]
    return "\n".join(out).rstrip() + "\n"


def _git_commit(cwd: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} + local changes" if dirty else head


def write_record(record: Mapping[str, Any], directory: Path | str = "results", slug: str | None = None,
                 numbered: bool = False) -> Path:
    """Write one measurement as ``directory/DATE-SLUG.json``, filling in what the caller left out: ``date``
    (today, UTC), ``cpu`` (``/proc/cpuinfo``'s model name) and ``commit`` (``git rev-parse --short HEAD`` of
    ``directory``'s checkout, ``+ local changes`` if the tree is dirty).

    Args:
        record: the record's keys (``title``, ``command`` and ``figures`` or ``table`` at least).
        directory: the results folder.
        slug: the file name's part after the date (default: from the title).
        numbered: when that name is taken, write ``<date>-<slug>-2.json``, ``-3`` ... (a benchmark run again the same
            day) instead of raising.

    Returns:
        the path written.

    Raises:
        RecordError: the completed record is not valid (:func:`validate`).
        FileExistsError: a record of that name exists and ``numbered`` is off (results are never overwritten).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    full = dict(record)
    full.setdefault("date", _dt.datetime.now(_dt.timezone.utc).date().isoformat())
    if "cpu" not in full:
        from moetrain.runtime.cpu import cpu_model

        full["cpu"] = cpu_model()
    full.setdefault("commit", _git_commit(directory))
    slug = slug or re.sub(r"[^a-z0-9]+", "-", str(full.get("title", "record")).lower()).strip("-")[:60]
    validate(full, f"{full['date']}-{slug}.json")
    for k in range(1, 1000 if numbered else 2):
        path = directory / f"{full['date']}-{slug}{f'-{k}' if k > 1 else ''}.json"
        try:
            with open(path, "x") as f:  # "x": never overwrite a measurement
                f.write(json.dumps(full, indent=2) + "\n")
            return path
        except FileExistsError:
            if not numbered:
                raise
    raise FileExistsError(f"{directory}: no free name for {full['date']}-{slug} records")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moetrain.results",
                                description="Render the results page of the docs from the JSON records.")
    p.add_argument("--results", default="results", help="the records' folder (default: results)")
    p.add_argument("--out", default="docs/results.md", help="the page to write (default: docs/results.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is out of date")
    args = p.parse_args(argv)
    try:
        text = render(load(Path(args.results)))
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is out of date with {args.results}/: run python -m moetrain.results", file=sys.stderr)
            return 1
        print(f"{out} is up to date ({len(list(Path(args.results).glob('*.json')))} records)")
        return 0
    out.write_text(text)
    print(f"wrote {out} from {args.results}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
