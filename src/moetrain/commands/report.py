"""``moetrain report RUN_DIR``: PNG figures and a self-contained HTML page of a run (finished or in progress)."""

from __future__ import annotations

from pathlib import Path

from moetrain.commands import check_output_path
from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="PNG figures and a self-contained HTML page of a run (finished or in progress)")
    r.add_argument("run_dir")
    r.add_argument("--out", help="output directory (default: RUN_DIR/report, rewritten on every call); must be "
                   "new or empty unless --overwrite")
    r.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out (replaces files named like the report's; deletes nothing)")
    r.set_defaults(func=run)


def run(args) -> int:
    from moetrain.commands.run_dir import refuse_hugging_face_dir
    from moetrain.report import build_report
    from moetrain.report.runlog import load_run_log

    refuse_hugging_face_dir(Path(args.run_dir), load_run_log(args.run_dir).config)
    if args.out is not None:  # the default RUN_DIR/report is the report's own: regenerated from the kept logs
        out = Path(args.out)
        check_output_path(out, "--out")
        if out.is_dir() and any(out.iterdir()) and not args.overwrite:
            raise MoetrainError(f"--out {out}: exists and is not empty; pass --overwrite to write the report into it "
                                "(files named like the report's are replaced) or choose another --out")
    report = build_report(args.run_dir, args.out)
    for path in report.figures:
        print(f"figure: {path}")
    if load_run_log(args.run_dir).dropless():
        print("figure: no drop_fraction.png: the run is dropless (model.moe.capacity.factor=null), so no token is "
              "ever dropped")
    print(f"report: {report.html}")
    return 0
