"""``moetrain compare VARIANT [VARIANT ...] --out DIR``: train variants of a config on the same tokens and seeds,
side by side, each (variant, seed) a child ``moetrain train`` process, then tabulate and plot their validation
losses per token and per second (docs/compare.md: the variants, the waves, what DIR holds, how to read it).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetrain.commands.compare_leads import last_trained_eval, lead_rows, leads_markdown, num
from moetrain.commands import check_at_least, check_output_path
from moetrain.errors import ConfigError, MoetrainError
from moetrain.results import markdown_table as results_table

MARKER = "compare-command.json"  # the command's settings, written first: what --overwrite may delete
FIGURES = ("loss_vs_tokens.png", "loss_vs_seconds.png")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=")
# Split NAME:a=1,b=[1,2] at the commas that start another FIELD=.
_ITEM_SPLIT = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_.]*\s*=)")
_LINE_STYLES = ("-", "--", ":", "-.")
_BF16_FLAGS = ("avx2", "avx512_bf16", "amx_bf16")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="train config variants on the same tokens and seeds side by side; table and "
                       "loss-vs-tokens / loss-vs-seconds plots")
    p.add_argument("variants", nargs="*", metavar="VARIANT",
                   help="a config file (.toml / .json) or NAME:FIELD=VALUE,FIELD=VALUE (NAME: alone = the preset); "
                   "e.g. dense:model.moe_every=0 moe: (the preset's dense twin: its FFN is as wide as the active experts)")
    p.add_argument("--out", required=True, help="output directory (must be new or empty unless --overwrite)")
    p.add_argument("--preset", help="the preset under every variant (default: a config file's own, else cpu-small)")
    p.add_argument("--data", help="text file, directory, glob or .jsonl for every run (data.path)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps of every run (train.steps)")
    budget.add_argument("--seconds", type=float,
                        help="wall-clock seconds of every run's training loop (train.time_budget_s; train.steps stays "
                        "the upper bound and the LR schedule's length)")
    p.add_argument("--seeds", default="0", help="comma-separated train.seed values, each run by every variant "
                   "(default 0)")
    p.add_argument("--threads-per-run", type=int, default=1, help="train.threads of every run (default 1)")
    p.add_argument("--parallel", type=int,
                   help="runs at a time (default: usable cores // --threads-per-run, at least 1)")
    p.add_argument("--overwrite", action="store_true", help="delete an existing DIR of an earlier compare first")
    p.set_defaults(func=run, overrides=[], extra_positionals=True)


# -- the variants ------------------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One variant from the command line.

    Attributes:
        name: its name (the spec's NAME, or the config file's stem); names the run directories.
        spec: the command-line text.
        file_data: the config file's fields (``None`` for a NAME:... spec).
        overrides: the spec's FIELD=VALUE fields, nested (``{"model": {"moe_every": 0}}``).
    """

    name: str
    spec: str
    file_data: dict[str, Any] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def is_override(item: str) -> bool:
    """Whether a positional argument is a shared ``FIELD=VALUE`` override rather than a variant (a config file that
    exists is always a variant)."""
    return _FIELD.match(item) is not None and not _is_file(item)


def _is_file(item: str) -> bool:
    """``Path(item).is_file()``, False where ``item`` cannot name a file (a variant spec longer than the system's
    file-name limit raises ``OSError: File name too long`` from ``is_file``)."""
    try:
        return Path(item).is_file()
    except OSError:
        return False


def parse_variant(spec: str) -> Variant:
    """A :class:`Variant` from a config file path or ``NAME:FIELD=VALUE,FIELD=VALUE``.

    Raises:
        ConfigError: an unreadable config file, a bad name, or an item that is not FIELD=VALUE (the message starts
            with ``variant 'SPEC':``).
    """
    from moetrain.config import upgrade
    from moetrain.configlib import load_file, parse_overrides

    where = f"variant '{spec}'"
    path = Path(spec)
    if _is_file(spec):
        try:
            data = upgrade(load_file(path))
        except ConfigError as e:
            raise ConfigError(f"{where}: {str(e).removeprefix('--config ')}") from None
        stem = path.parent.resolve().name if path.stem == "config" else path.stem  # RUN_DIR/config.json: RUN_DIR
        return Variant(re.sub(r"[^A-Za-z0-9_.-]", "-", stem).lstrip(".-_") or "config", spec, data)
    if ":" not in spec:
        raise ConfigError(f"{where}: no such config file, and not NAME:FIELD=VALUE,... (NAME: alone runs the preset "
                          "as is)")
    name, _, rest = spec.partition(":")
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: the name '{name}' must start with a letter or digit and hold only letters, "
                          "digits, '.', '_' and '-'")
    items = [item.strip() for item in _ITEM_SPLIT.split(rest)] if rest.strip() else []
    try:
        overrides = upgrade(parse_overrides(items))
    except ConfigError as e:
        raise ConfigError(f"variant '{name}': {e}") from None
    return Variant(name, spec, None, overrides)


def parse_seeds(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``.

    Raises:
        ConfigError: an item that is not an integer, a repeated seed, or no seed.
    """
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds: expected comma-separated integers such as 0,1, got '{text}'") from None
    if not seeds:
        raise ConfigError("--seeds: give at least one seed, e.g. --seeds 0")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds: a seed is repeated in '{text}'")
    return seeds


# The fields the command sets over every variant's own: field -> (its option, the option's value in ``args``; the
# seed is the run's).
FORCED = {"train.seed": ("--seeds", "seed"), "train.threads": ("--threads-per-run", "threads_per_run"),
          "data.path": ("--data", "data"), "train.steps": ("--steps", "steps"),
          "train.time_budget_s": ("--seconds", "seconds")}


def _nested_get(data: dict[str, Any] | None, path: str) -> Any:
    node: Any = data or {}
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def forced_fields(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The :data:`FORCED` fields given (``train.seed`` and ``train.threads`` always), nested."""
    values = {**vars(args), "seed": seed}
    forced: dict[str, Any] = {}
    for path, (_, option) in FORCED.items():
        if values[option] is not None:
            section, name = path.split(".")
            forced.setdefault(section, {})[name] = values[option]
    return forced


def resolve(variant: Variant, preset: str | None, shared: dict[str, Any], forced: dict[str, Any]) -> Any:
    """The variant's :class:`~moetrain.config.Config`: preset, then the config file, then the shared overrides,
    then the variant's own overrides, then ``forced``.

    Raises:
        ConfigError: unknown or invalid fields (the message starts with ``variant 'NAME':`` and names the field).
    """
    from moetrain.config import build_config, check_router_trainable
    from moetrain.configlib import merge

    try:
        config = build_config(preset, variant.file_data, merge(merge(shared, variant.overrides), forced))
        check_router_trainable(config)
        return config
    except ConfigError as e:
        raise ConfigError(f"variant '{variant.name}': {e}") from None


# -- the runs ----------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One (variant, seed) child run.

    Attributes:
        variant / seed: what it trains.
        config: its resolved :class:`~moetrain.config.Config`.
        name: ``NAME-sSEED``: its run directory, config and log file names.
        params_total / params_active: parameters of the model, and those active per token (top-k of each MoE
            layer's experts), counted on the meta device.
        exit_code: the child's exit status (``None`` until it ended).
        seconds: the child process's wall time (s), start-up and data loading included.
        wave: the index of the wave it runs in (:func:`plan_waves`).
    """

    variant: str
    seed: int
    config: Any
    name: str
    params_total: int = 0
    params_active: int = 0
    exit_code: int | None = None
    seconds: float = 0.0
    wave: int = 0


def count_params(config: Any) -> tuple[int, int]:
    """(total, active) parameters of ``config.model`` (built on the meta device, no memory)."""
    import torch

    from moetrain.model.transformer import MoETransformer, count_parameters

    with torch.device("meta"):
        model = MoETransformer(config.model)
    return count_parameters(model)


def _child_env(threads: int) -> dict[str, str]:
    """This environment for a child run: one process (no torchrun variables), ``threads`` OpenMP threads,
    unbuffered output (its log grows as it runs)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return env


def plan_waves(runs: list[Run], parallel: int) -> list[list[Run]]:
    """The waves ``runs`` (seed-major, the variants in command-line order) start in; sets each run's ``wave``.
    With V variants a wave holds ``parallel // V`` whole seeds when ``parallel >= V``, else ``parallel`` of one
    seed's variants in order: one seed's variants never straddle waves to fill a slot."""
    groups = [list(g) for _, g in itertools.groupby(runs, key=lambda r: r.seed)]
    width = max((len(g) for g in groups), default=1)
    if parallel >= width:
        per_wave = parallel // width
        waves = [[r for g in groups[i:i + per_wave] for r in g] for i in range(0, len(groups), per_wave)]
    else:
        waves = [g[i:i + parallel] for g in groups for i in range(0, len(g), parallel)]
    for n, wave in enumerate(waves):
        for r in wave:
            r.wave = n
    return waves


def run_waves(out: Path, runs: list[Run], parallel: int, threads: int) -> None:
    """Run ``runs`` in the waves of :func:`plan_waves`: each wave starts together and ends before the next starts
    (so the runs of a wave share the machine for their whole length). Sets each run's ``exit_code``, ``seconds``
    and ``wave``; console output goes to ``DIR/logs/NAME-sSEED.log``. On Ctrl-C the running children get SIGTERM
    (they stop with a checkpoint) and the interrupt is raised again."""
    env = _child_env(threads)
    waves = plan_waves(runs, parallel)
    for n, wave in enumerate(waves, 1):
        print(f"wave {n}/{len(waves)}: {', '.join(r.name for r in wave)}", flush=True)
        procs: list[tuple[Run, subprocess.Popen[bytes], float]] = []
        try:
            for r in wave:
                command = [sys.executable, "-m", "moetrain", "train", "--config",
                           str(out / "configs" / f"{r.name}.json"), "--out", str(out / "runs" / r.name),
                           "--no-progress"]
                with open(out / "logs" / f"{r.name}.log", "wb") as log:
                    procs.append((r, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL, env=env), time.perf_counter()))
            pending = list(procs)
            while pending:
                time.sleep(0.2)
                for item in list(pending):
                    r, proc, t0 = item
                    code = proc.poll()
                    if code is None:
                        continue
                    pending.remove(item)
                    r.exit_code, r.seconds = code, time.perf_counter() - t0
                    status = "done" if code == 0 else f"FAILED (exit {code}; see {out / 'logs' / (r.name + '.log')})"
                    print(f"  {r.name}: {status} in {r.seconds:.0f} s", flush=True)
        except BaseException:
            for _, proc, _ in procs:
                if proc.poll() is None:
                    proc.terminate()
            for _, proc, _ in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            raise


# -- the results -------------------------------------------------------------------------------------------------
def summarize_run(out: Path, run: Run) -> dict[str, Any]:
    """One run's entry of ``compare.json``, from its ``metrics.jsonl``.

    Keys: ``variant``, ``seed``, ``run_dir``, ``log``, ``exit_code``, ``process_seconds`` (the child's wall time,
    s), ``params_total`` / ``params_active``, ``tokens_per_step`` (batch_size x grad_accum x seq_len, padding
    included), ``wave`` (:func:`plan_waves`), ``steps`` (the last step logged), ``stopped_by`` (``steps``,
    ``time budget`` or ``incomplete``), ``evals`` (every evaluation: ``step``, ``tokens`` seen, ``seconds`` of the
    training loop (``elapsed_s``: wall seconds, the evaluations and checkpoints before it included; 0 at step 0),
    ``val_loss`` in nats/token), ``final_val_loss`` (of the last evaluation after step 0; ``None`` without one),
    ``median_tokens_per_s`` (over the logging intervals) and ``first_batch_sha256`` (the tokens of its first
    batch). A run that wrote no metrics has empty ``evals`` and ``None`` values.
    """
    from moetrain.report.runlog import load_run_log

    cfg = run.config
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len
    run_dir = out / "runs" / run.name
    records: list[dict[str, Any]] = []
    with contextlib.suppress(MoetrainError):  # the run failed before writing anything
        records = load_run_log(run_dir).records
    evals: dict[int, dict[str, Any]] = {}
    for rec in records:
        if rec.get("val_loss") is not None:
            step = rec["step"]
            seconds = 0.0 if step == 0 else rec.get("elapsed_s")
            evals[step] = {"step": step, "tokens": step * tokens_per_step, "seconds": seconds,
                           "val_loss": rec["val_loss"]}
    rates = [r["tokens_per_s"] for r in records if isinstance(r.get("tokens_per_s"), (int, float))]
    sha = next((r["first_batch_sha256"] for r in records if r.get("first_batch_sha256")), None)
    steps = max((r["step"] for r in records), default=0)
    if steps >= cfg.train.steps:
        stopped_by = "steps"
    elif cfg.train.time_budget_s and run.exit_code == 0 and steps > 0:
        stopped_by = "time budget"
    else:
        stopped_by = "incomplete"
    ordered = [evals[s] for s in sorted(evals)]
    last = last_trained_eval(ordered)  # a run that failed in its first steps has only step 0's
    return {
        "variant": run.variant, "seed": run.seed, "run_dir": str(run_dir), "log": str(out / "logs" / f"{run.name}.log"),
        "exit_code": run.exit_code, "process_seconds": round(run.seconds, 2), "wave": run.wave,
        "params_total": run.params_total, "params_active": run.params_active, "tokens_per_step": tokens_per_step,
        "steps": steps, "stopped_by": stopped_by, "evals": ordered,
        "final_val_loss": None if last is None else last["val_loss"],
        "median_tokens_per_s": statistics.median(rates) if rates else None, "first_batch_sha256": sha,
    }


def machine_info() -> dict[str, Any]:
    """The date, CPU model (``/proc/cpuinfo``), the bf16-related CPU flags, usable cores, torch and Python
    versions."""
    import platform

    import torch

    from moetrain.runtime.cpu import cpu_flags, cpu_model
    from moetrain.runtime.threads import usable_cores

    flags = cpu_flags()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu_model": cpu_model(),
            "cpu_flags": {f: f in flags for f in _BF16_FLAGS}, "usable_cores": usable_cores(),
            "torch": torch.__version__, "python": platform.python_version()}


def eval_columns(summaries: list[dict[str, Any]]) -> list[int]:
    """The steps that get a column of their own: every evaluation step > 0 but a run's last one when a time budget
    stopped it there (those only show as its final loss)."""
    return sorted({e["step"] for s in summaries for e in s["evals"]
                   if e["step"] > 0 and not (s["stopped_by"] == "time budget" and e["step"] == s["steps"])})


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    """The runs as a markdown table: variant, seed, params (active), val loss at each evaluation step, steps run,
    training seconds, final val loss, median tokens/s; ``-`` where a run has no value."""
    columns = eval_columns(summaries)
    header = ["variant", "seed", "params (active)", *(f"val @ {s}" for s in columns), "steps", "train s",
              "final val loss", "median tokens/s"]
    rows = []
    for s in summaries:
        by_step = {e["step"]: e["val_loss"] for e in s["evals"]}
        cells = [s["variant"], str(s["seed"]), f"{_millions(s['params_total'])} ({_millions(s['params_active'])})"]
        cells += [num(by_step.get(c), ".3f") for c in columns]
        last = last_trained_eval(s["evals"])
        steps = str(s["steps"]) if s["exit_code"] == 0 else f"{s['steps']} (exit {s['exit_code']})"
        cells += [steps, num(None if last is None else last["seconds"], ".1f"), num(s["final_val_loss"], ".3f"),
                  num(s["median_tokens_per_s"], ".0f")]
        rows.append(cells)
    return "\n".join(results_table(header, rows))


# Settings that add work to a run's clock (elapsed_s) outside its optimizer steps.
CLOCK_FIELDS = ("eval_every", "eval_batches", "ckpt_every", "log_every")


def seconds_notes(runs: list[Run]) -> list[str]:
    """Warnings for ``compare.md`` when the variants differ in what their clocks hold besides training:
    ``elapsed_s`` counts the evaluations, checkpoints and logging steps' statistics before each step, so a variant
    that evaluates or saves more often is slower per second by that work alone."""
    notes = []
    for name in CLOCK_FIELDS:
        values = {r.variant: getattr(r.config.train, name) for r in runs}
        if len(set(values.values())) > 1:
            text = ", ".join(f"{k} {v}" for k, v in values.items())
            notes.append(f"Note: the variants differ in train.{name} ({text}): their seconds and tokens/s include "
                         "different evaluation / checkpoint / logging work, so the leads at the same seconds and the "
                         "tokens/s ratios are not of the training alone.")
    return notes


def same_tokens(summaries: list[dict[str, Any]]) -> dict[int, bool | None]:
    """Per seed: whether every run of it logged the same ``first_batch_sha256`` (``None``: a run logged none)."""
    out: dict[int, bool | None] = {}
    for seed in dict.fromkeys(s["seed"] for s in summaries):
        shas = [s["first_batch_sha256"] for s in summaries if s["seed"] == seed]
        out[seed] = None if None in shas else len(set(shas)) == 1
    return out


def render_markdown(report: dict[str, Any]) -> str:
    """``compare.md``: the machine and settings, the table, and the same-tokens check of each seed."""
    m, st = report["machine"], report["settings"]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in m["cpu_flags"].items())

    def load(values: list[float] | None) -> str:
        return "unknown" if values is None else " / ".join(f"{v:.2f}" for v in values)

    if st["seconds"] is not None:
        budget = f"{st['seconds']:g} s of training each (train.time_budget_s)"
    else:
        budget = f"{st['steps']} steps" if st["steps"] is not None else "train.steps of the configs"
    lines = [
        "# moetrain compare", "",
        f"{m['date']}; CPU {m['cpu_model']} ({flags}); torch {m['torch']}; {m['usable_cores']} usable cores; "
        f"load average (1 / 5 / 15 min) before {load(report['loadavg_before'])}, "
        f"after {load(report['loadavg_after'])}.",
        "",
        f"Preset {st['preset'] or 'default'}, data {st['data'] or 'the config'}, budget {budget}, seeds "
        f"{', '.join(map(str, st['seeds']))}, {st['parallel']} run(s) at a time with {st['threads_per_run']} "
        f"thread(s) each; shared overrides: {' '.join(st['overrides']) or 'none'}.",
        "", "Variants: " + "; ".join(f"`{v['name']}` = `{v['spec']}`" for v in report["variants"]) + ".", "",
        markdown_table(report["runs"]), "",
        "Val loss in nats/token on the same validation batches; `train s`: wall seconds of the training loop at the "
        "last evaluation after step 0 (its evaluations and checkpoints included); tokens/s: the median over the "
        "logging intervals.", "",
    ]
    for seed, same in report["same_first_batch"].items():
        shas = {s["variant"]: s["first_batch_sha256"] for s in report["runs"] if s["seed"] == seed}
        if same:
            lines.append(f"- seed {seed}: every variant trained on the same first batch "
                         f"(sha256 {next(iter(shas.values()))}).")
        else:
            text = ", ".join(f"{k} {v or 'none logged'}" for k, v in shas.items())
            lines.append(f"- seed {seed}: the first batches DIFFER ({text}): a variant changes the data, the "
                         "tokenizer (model.vocab_size) or the batch shape, or a run failed.")
    if report.get("leads"):
        lines += ["", leads_markdown(report["leads"])]
    for note in report.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def write_figures(out: Path, summaries: list[dict[str, Any]]) -> list[Path]:
    """``loss_vs_tokens.png`` and ``loss_vs_seconds.png``: validation loss per run, colour per variant, line style
    per seed, every evaluation from the one before training (step 0) on. Step 0's loss (about ln V) is far above
    the rest, so the loss axis is logarithmic when the losses span more than a factor of 1.5: the later
    differences stay visible.

    Raises:
        MoetrainError: matplotlib is missing.
    """
    from moetrain.report.figures import _empty, _pyplot, _save

    plt = _pyplot()
    from matplotlib import ticker

    colours = {v: f"C{i % 10}" for i, v in enumerate(dict.fromkeys(s["variant"] for s in summaries))}
    styles = {seed: _LINE_STYLES[i % len(_LINE_STYLES)]
              for i, seed in enumerate(dict.fromkeys(s["seed"] for s in summaries))}
    paths = []
    for name, key, label in ((FIGURES[0], "tokens", "tokens seen"),
                             (FIGURES[1], "seconds", "wall-clock seconds of training")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for s in summaries:
            points = [(e[key], e["val_loss"]) for e in s["evals"] if e[key] is not None and e["val_loss"] is not None]
            if points:
                ax.plot(*zip(*points), linestyle=styles[s["seed"]], marker="o", markersize=3,
                        color=colours[s["variant"]], label=f"{s['variant']} (seed {s['seed']})")
        if ax.lines:
            ax.legend(fontsize=8)
            losses = [y for line in ax.lines for y in line.get_ydata()]
            if min(losses) > 0 and max(losses) > 1.5 * min(losses):
                ax.set_yscale("log")
                ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%.1f"))
                ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.1f"))
        else:
            _empty(ax, "no validation losses logged")
        ax.set(xlabel=label, ylabel="validation loss (nats/token)", title=f"Validation loss against {label}")
        ax.grid(alpha=0.3)
        paths.append(_save(plt, fig, out / name))
    return paths


# -- the command -------------------------------------------------------------------------------------------------
def _notes(variant: Variant, shared: dict[str, Any], forced: dict[str, Any]) -> list[str]:
    """A note for each field the variant or the shared overrides set that the command replaces."""
    notes = []
    for path, (flag, _) in FORCED.items():
        value = _nested_get(forced, path)
        if value is None:
            continue
        for source in (variant.file_data, shared, variant.overrides):
            given = _nested_get(source, path)
            if given is not None and given != value:
                notes.append(f"note: variant '{variant.name}': {path}={given!r} is replaced by {flag} ({value!r})")
                break
    return notes


def _prepare_data(configs: list[Any]) -> None:
    """Tokenize each distinct corpus once, here, so the runs read one token cache and start alike (two runs
    building the same cache at once would both train the tokenizer).

    Raises:
        DataError: a missing path or unusable corpus (as ``train`` would say).
    """
    from moetrain.data.dataset import prepare_data

    seen = set()
    for cfg in configs:
        key = json.dumps([cfg.to_dict()["data"], cfg.model.vocab_size], sort_keys=True)
        if key not in seen:
            seen.add(key)
            prepare_data(cfg.data, cfg.model.vocab_size, log=lambda line: print(line, flush=True))


def run(args: argparse.Namespace) -> int:
    from moetrain.configlib import parse_overrides

    items = [*args.variants, *args.overrides]
    shared_items = [i for i in items if is_override(i)]
    variants = [parse_variant(i) for i in items if not is_override(i)]
    if not variants:
        raise ConfigError("compare: give at least one VARIANT (a config file or NAME:FIELD=VALUE,...; NAME: alone "
                          "is the preset), e.g. moetrain compare dense:model.moe_every=0 moe: --out DIR")
    names: dict[str, str] = {}
    for v in variants:
        if v.name in names:
            raise ConfigError(f"variant '{v.spec}': its name '{v.name}' is taken by variant '{names[v.name]}'; "
                              "give each variant its own NAME")
        names[v.name] = v.spec
    seeds = parse_seeds(args.seeds)
    check_at_least(args, 1, "threads_per_run", "parallel", "steps")
    if args.seconds is not None and not args.seconds > 0:
        raise ConfigError(f"--seconds: must be > 0, got {args.seconds:g}")
    from moetrain.config import upgrade

    shared = upgrade(parse_overrides(shared_items))

    runs: list[Run] = []
    notes: list[str] = []
    for seed in seeds:  # seed-major: one wave holds the variants of one seed
        for v in variants:
            forced = forced_fields(args, seed)
            config = resolve(v, args.preset, shared, forced)
            if seed == seeds[0]:
                notes += _notes(v, shared, forced)
            runs.append(Run(v.name, seed, config, f"{v.name}-s{seed}"))
    from moetrain.commands.train import check_data_path

    for path in dict.fromkeys(r.config.data.path for r in runs):
        check_data_path(path)
    # torch (runtime.threads) only after the configs and data paths passed: a mistyped field answers at once
    from moetrain.runtime.threads import usable_cores

    parallel = args.parallel or max(1, usable_cores() // args.threads_per_run)
    out = Path(args.out)
    check_output_path(out, "--out", overwrite=args.overwrite, overwrite_does="replace an earlier compare there")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise MoetrainError(f"--overwrite: '{out}' is not a moetrain compare directory (no {MARKER}); refusing to "
                            "delete it")
    from moetrain.report.figures import _pyplot

    _pyplot()  # matplotlib missing: one line now rather than after the training
    for note in notes:
        print(note, file=sys.stderr)
    counts: dict[str, tuple[int, int]] = {}
    for r in runs:
        if r.variant not in counts:
            counts[r.variant] = count_params(r.config)
        r.params_total, r.params_active = counts[r.variant]
    _prepare_data([r.config for r in runs])  # after every check: a mistyped --data costs nothing here

    if out.exists():
        shutil.rmtree(out)  # checked above: empty, or an earlier compare with --overwrite
    for sub in ("configs", "logs", "runs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    settings = {"preset": args.preset, "data": args.data, "steps": args.steps, "seconds": args.seconds,
                "seeds": seeds, "threads_per_run": args.threads_per_run, "parallel": parallel,
                "overrides": shared_items}
    command = {"variants": [v.spec for v in variants], **settings, "cwd": os.getcwd(),
               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (out / MARKER).write_text(json.dumps(command, indent=2) + "\n")
    for r in runs:
        (out / "configs" / f"{r.name}.json").write_text(json.dumps(r.config.to_dict(), indent=2) + "\n")

    from moetrain.runtime.threads import load_average

    machine, before = machine_info(), load_average()
    print(f"{len(runs)} runs, {parallel} at a time with {args.threads_per_run} thread(s) each; logs in "
          f"{out / 'logs'}", flush=True)
    run_waves(out, runs, parallel, args.threads_per_run)
    after = load_average()

    summaries = [summarize_run(out, r) for r in runs]
    leads = lead_rows(summaries)
    report: dict[str, Any] = {
        "machine": machine, "loadavg_before": before, "loadavg_after": after,
        "settings": settings,
        "variants": [{"name": v.name, "spec": v.spec} for v in variants],
        "runs": summaries, "same_first_batch": same_tokens(summaries), "notes": seconds_notes(runs),
        "leads": leads,
    }
    (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "compare.md").write_text(render_markdown(report))
    figures = write_figures(out, summaries)
    for path in [out / "compare.json", out / "compare.md", *figures]:
        print(f"wrote {path}")
    print()
    print("\n\n".join(part for part in (markdown_table(summaries), leads_markdown(leads), *report["notes"]) if part))
    failed = [r for r in runs if r.exit_code != 0]
    if failed:
        print(f"moetrain: error: {len(failed)} of {len(runs)} runs failed: "
              + ", ".join(f"{r.name} (exit {r.exit_code}, {out / 'logs' / (r.name + '.log')})" for r in failed),
              file=sys.stderr)
        return 1
    return 0
