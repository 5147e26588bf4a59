"""``moetrain bench NAME ...``: benchmarks that print a table and write JSON.

Each benchmark lives in ``moetrain.bench.<name>`` and defines ``add_parser(sub)`` (which calls
``set_defaults(func=run)``); add one by adding its name to :data:`BENCHES`.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = ["bta", "moe", "train"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    inner = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHES:
        importlib.import_module(f"moetrain.bench.{name}").add_parser(inner)
    for command in inner.choices.values():  # `moetrain bench NAME ... --debug`, as for the other commands
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
