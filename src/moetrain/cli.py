"""Command-line interface: ``moetrain <command>``; each command lives in ``moetrain.commands.<name>``.

User errors (:class:`~moetrain.errors.MoetrainError`) and command-line syntax errors print one line
``moetrain: error: ...`` and exit with status 2; ``--debug`` (before or after the subcommand) shows the traceback
instead. An ``OSError`` (a read-only or full disk, a permission) is one line too, naming the path
(:mod:`moetrain.runtime.oserrors`), with status 2. A reader that closes the pipe early (``moetrain stats RUN | head -1``) ends the command quietly with
status 141, as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from moetrain.errors import MoetrainError

# Subcommand modules, in help order; each defines add_parser(subparsers).
COMMANDS = ["train", "generate", "eval", "report", "stats", "compare", "plan", "bench", "doctor", "export", "upcycle",
            "serve", "placement"]


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``PROG: error: MESSAGE``), exit status 2, without the usage block.
    Subcommand parsers inherit the class (``add_subparsers`` uses the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moetrain")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="moetrain", description="Train and run Mixture-of-Experts language models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"moetrain {_version()}")
    sub = parser.add_subparsers(dest="command")
    for name in COMMANDS:
        importlib.import_module(f"moetrain.commands.{name}").add_parser(sub)
    for command in sub.choices.values():  # `moetrain train ... --debug` works too; SUPPRESS keeps the top level's
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line ``argv`` (without the program name) as the command's arguments, nothing run.

    Raises:
        SystemExit: a syntax error (status 2, after one line on stderr), ``--help`` or ``--version`` (status 0).
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:  # `moetrain` alone runs the default job
        args, extra = parser.parse_known_args([*argv, "train"])
    # FIELD=VALUE overrides may appear anywhere after the command (argparse only takes a trailing positional list);
    # a command with extra_positionals (compare's variants) takes any positional there and sorts them itself.
    if extra:
        loose = getattr(args, "extra_positionals", False)
        if not hasattr(args, "overrides") or any(e.startswith("-") or ("=" not in e and not loose) for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from moetrain.runtime.oserrors import quiet_thread_os_errors

    quiet_thread_os_errors()  # TensorBoard's writer thread on a full disk: one line, not a traceback
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here rather than as an "Exception ignored" at exit
        return code
    except BrokenPipeError:
        # `moetrain stats RUN | head -1`: the reader left. Python's recipe: point stdout at devnull so the flush at
        # exit cannot fail again, and exit quietly with the status of a process killed by SIGPIPE (128 + 13).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (MoetrainError, OSError) as e:  # an OSError is the machine's, not the input's: one line naming the path
        if getattr(args, "debug", False):
            raise
        from moetrain.runtime.oserrors import os_error_line

        line = str(e) if isinstance(e, MoetrainError) else os_error_line(e)
        print(f"moetrain: error: {' '.join(line.split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moetrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
