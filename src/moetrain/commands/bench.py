"""``moetrain bench NAME ...``: benchmarks that print a table and write JSON.

Each benchmark lives in ``moetrain.bench.<name>`` and defines ``add_parser(sub)`` (which calls
``set_defaults(func=run)``); add one by adding its name to :data:`BENCHES`. The arguments benchmarks share
(``--threads``, ``--steps`` / ``--reps``, ``--warmup``, ``--json``, ``--overwrite``, ``--device``, and ``bench
train``'s ``--batch`` / ``--seq`` / ``--lr``) are checked here before the benchmark starts, so a bad value is a
one-line error rather than a traceback minutes later. The JSON goes where ``--json`` says, else to a new file under
the temp directory (:func:`moetrain.bench.default_output`), never into the current directory; an existing ``--json``
file is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
from pathlib import Path

from moetrain.commands import check_at_least, check_output_path
from moetrain.errors import ConfigError, MoetrainError

BENCHES = ["bta", "moe", "train"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    inner = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in BENCHES:
        importlib.import_module(f"moetrain.bench.{name}").add_parser(inner)
    for command in inner.choices.values():  # `moetrain bench NAME ... --debug`, as for the other commands
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        command.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
        command.set_defaults(func=functools.partial(_checked, command.get_default("func")))


def _checked(func, args) -> int:
    check_at_least(args, 0, "threads", "warmup")  # --threads 0: PyTorch's default
    check_at_least(args, 1, "steps", "reps", "batch")
    if args.bench == "train":
        _check_train(args)
    if args.json is None:  # a new file under the temp directory, never the current directory
        from moetrain.bench import default_output

        args.json = str(default_output(args.bench))
    elif Path(args.json).exists() and not Path(args.json).is_dir() and not args.overwrite:
        raise MoetrainError(f"--json {args.json}: exists; pass --overwrite to replace it or choose another file")
    check_output_path(Path(args.json), "--json", "file")
    import torch

    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this PyTorch sees no CUDA device (torch.cuda.is_available() is False)")
    if args.threads:  # 0 (bench bta) or none: PyTorch's default
        torch.set_num_threads(args.threads)
    return func(args)


def _check_train(args) -> None:
    from moetrain.config import build_config

    if not (args.lr > 0 and math.isfinite(args.lr)):  # AdamW raises a bare ValueError only after the models are built
        raise ConfigError(f"--lr: must be > 0 and finite, got {args.lr:g}")
    if args.seq is not None:
        if args.seq < 2:
            raise ConfigError(f"--seq: must be >= 2 (inputs and shifted targets), got {args.seq}")
        context = build_config(args.preset).model.max_seq_len  # ConfigError for an unknown preset
        if args.seq > context:
            raise ConfigError(f"--seq: {args.seq} exceeds the context of preset {args.preset} "
                              f"(model.max_seq_len={context})")
