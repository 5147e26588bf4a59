"""``moetrain report RUN_DIR``: PNG figures and a self-contained HTML page of a run (finished or in progress)."""

from __future__ import annotations

from pathlib import Path

from moetrain.commands import check_output_path


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="PNG figures and a self-contained HTML page of a run (finished or in progress)")
    r.add_argument("run_dir")
    r.add_argument("--out", help="output directory (default: RUN_DIR/report, rewritten on every call); must be "
                   "new or empty unless --overwrite")
    r.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out (replaces files named like the report's; deletes nothing)")
    r.set_defaults(func=run)


def run(args) -> int:
    from moetrain.report import build_report
    from moetrain.report.runlog import load_run_log

    log = load_run_log(args.run_dir)  # the errors of a directory that is not a run's, before anything is written
    if args.out is not None:  # the default RUN_DIR/report is the report's own: regenerated from the kept logs
        check_output_path(Path(args.out), "--out", overwrite=args.overwrite,
                          overwrite_does="write the report into it (files named like the report's are replaced)")
    report = build_report(args.run_dir, args.out)
    for path in report.figures:
        print(f"figure: {path}")
    if not log.has_moe_layers():
        print("figure: no routing figures: the model has no MoE layers (model.moe_every / first_k_dense)")
    elif log.dropless():
        print("figure: no drop_fraction.png: the run is dropless (model.moe.capacity.factor=null), so no token is "
              "ever dropped")
    print(f"report: {report.html}")
    return 0
