"""``moetrain stats RUN_DIR``: the latest per-layer routing table of a run (finished or in progress)."""

from __future__ import annotations

from moetrain.commands import check_at_least


def add_parser(sub) -> None:
    s = sub.add_parser("stats", help="latest per-layer routing statistics of a run (finished or in progress)")
    s.add_argument("run_dir")
    s.add_argument("--alarms", type=int, default=5, help="how many of the newest alarms to list (default 5)")
    s.set_defaults(func=run)


def run(args) -> int:
    from moetrain.report.runlog import load_run_log
    from moetrain.report.table import HEADER, format_table, layer_rows, monitor_enabled, run_summary

    check_at_least(args, 0, "alarms")
    log = load_run_log(args.run_dir)
    print(f"run: {log.run_dir}")
    for label, value in run_summary(log):
        print(f"  {label}: {value}")
    rows = layer_rows(log)
    print()
    if rows:
        print(format_table(HEADER, rows))
    elif not log.has_moe_layers():
        print("no routing statistics: the model has no MoE layers (model.moe_every / first_k_dense)")
    elif monitor_enabled(log):
        print("no routing statistics logged yet")
    else:
        print("no routing statistics: the routing monitor was off (monitor.enabled=false)")
    if log.alerts and args.alarms > 0:
        print()
        print(f"newest alarms ({min(args.alarms, len(log.alerts))} of {len(log.alerts)}; all in alerts.jsonl):")
        for a in log.alerts[-args.alarms:]:
            print(f"  step {a.get('step')} [{a.get('kind')}] {a.get('message')}")
    return 0
