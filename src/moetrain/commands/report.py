"""``moetrain report RUN_DIR``: PNG figures and a self-contained HTML page of a run (finished or in progress)."""

from __future__ import annotations


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="PNG figures and a self-contained HTML page of a run (finished or in progress)")
    r.add_argument("run_dir")
    r.add_argument("--out", help="output directory (default: RUN_DIR/report)")
    r.set_defaults(func=run)


def run(args) -> int:
    from moetrain.report import build_report

    report = build_report(args.run_dir, args.out)
    for path in report.figures:
        print(f"figure: {path}")
    print(f"report: {report.html}")
    return 0
