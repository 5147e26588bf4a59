"""``moetrain train``: train a model (default: the cpu-small preset on the Python standard-library corpus)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

from moetrain.commands import check_at_least, check_output_path
from moetrain.configlib import load_file, merge, parse_overrides
from moetrain.errors import MoetrainError
from moetrain.train.restart import RESTART_ENV, torchrun_restart
from moetrain.train.run_lock import LOCK_FILE, RunLock


EPILOG = """\
config fields: set any field with FIELD=VALUE anywhere after `train` (values as in a config file: numbers,
true / false, null, strings plain, lists [a, b]), or in a --config FILE.toml / .json; e.g.
  moetrain train --preset tiny train.steps=100 model.moe_every=0
every field with its value in the preset, its type and meaning:
  moetrain train --list-fields --preset tiny
(each in full: docs/configuration.md)
"""


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (default: the cpu-small preset on the Python stdlib corpus)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="tiny | cpu-small (default); the shape-only mixtral-8x7b, qwen3-30b-a3b and "
                   "olmoe-1b-7b are for plan, not training")
    p.add_argument("--config", help="a .toml or .json file of config fields (applied over the preset)")
    p.add_argument("--data", help="text file, directory, glob or .jsonl; default: the Python standard library")
    p.add_argument("--out", help="run directory (default: runs/PRESET-TIMESTAMP)")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint (model.* and data.* stay fixed); "
                   "starts it when --out does not exist yet, so a restart loop can always pass --resume")
    p.add_argument("--overwrite", action="store_true", help="delete an existing --out directory first")
    p.add_argument("--stop-at-step", type=int, help="stop (with a checkpoint) after this step; --resume continues")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--init-from", metavar="HF_DIR",
                   help="fine-tune a Hugging Face checkpoint: model and tokenizer from HF_DIR (see export, upcycle)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config and print its parallel layout, per-rank memory and optimizer groups "
                        "for --world-size ranks (model on the meta device; no data, no run directory; with "
                        "--resume: the run's own config with this command's changes, nothing written)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks for --dry-run (default: $WORLD_SIZE, or 1)")
    p.add_argument("--list-fields", action="store_true",
                   help="print every config field with its value (the preset's, with --config and FIELD=VALUE on "
                        "top), type and meaning, then exit")
    p.add_argument("overrides", nargs="*", metavar="FIELD=VALUE", help="e.g. model.moe.top_k=1 train.lr=1e-3")
    p.set_defaults(func=run)


# What a run directory holds before its config.json: the lock, the tokenizer and their temporary files.
_EARLY_FILES = re.compile(rf"{re.escape(LOCK_FILE)}|tokenizer\.json|\.(tokenizer|config)\.json\.tmp-\d+")


def _started_but_empty(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a run whose first process stopped before writing config.json (so before any
    checkpoint or metric): it holds only files of :data:`_EARLY_FILES`, nothing a new start could lose."""
    if not run_dir.is_dir() or (run_dir / "config.json").exists():
        return False
    names = os.listdir(run_dir)
    return bool(names) and all(_EARLY_FILES.fullmatch(n) for n in names)


def _clear(run_dir: Path, keep: str = LOCK_FILE) -> None:
    """Delete everything in ``run_dir`` but ``keep`` (the lock this process holds)."""
    for p in run_dir.iterdir():
        if p.name != keep:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _resumed_config(run_dir: Path, args, file_data: dict | None, overrides: dict):
    """The run's saved config with the --config file and overrides on top, and the fields that changed.

    Raises:
        MoetrainError: an unreadable config.json, a --preset other than the run's, or a change to a field fixed for
            the run (:mod:`moetrain.train.resume_config`).
    """
    from moetrain.commands.run_dir import read_run_config
    from moetrain.config import Config, upgrade
    from moetrain.train.resume_config import resume_changes

    data = upgrade(read_run_config(run_dir))  # a run written with older field paths: moved to the new ones (with a note each)
    saved = Config.from_dict(data)
    if args.preset is not None and args.preset != saved.preset:
        raise MoetrainError(f"--preset {args.preset} cannot be combined with --resume of a run started from preset "
                            f"'{saved.preset}' (the run keeps its own config; change fields with FIELD=VALUE)")
    config = Config.from_dict(merge(merge(data, file_data or {}), overrides))
    return config, resume_changes(saved, config)


def check_data_path(path: str | None) -> None:
    """Refuse a ``data.path`` naming nothing before torch is imported (a missing file answers at once); the full
    discovery (and its error for a glob matching no files) is :func:`moetrain.data.corpus.discover_files`'s.

    Raises:
        DataError: the path does not exist (or is a broken link, or a glob matches no files).
    """
    if path is None:
        return
    target = Path(path).expanduser()
    if not (target.is_file() or target.is_dir()):
        from moetrain.data.corpus import discover_files

        discover_files(path)


def run(args) -> int:
    # Everything up to the config and data checks stays clear of torch (an import of seconds), so a mistyped field or
    # a missing --data file answers at once; tests/test_cli_fast_errors.py holds it.
    from moetrain.config import LEGACY_PATHS, Config, build_config, check_router_trainable, upgrade
    from moetrain.configlib import check_types
    from moetrain.presets import SHAPE_ONLY

    check_at_least(args, 1, "stop_at_step")
    overrides = upgrade(parse_overrides(args.overrides))  # old field paths still work, with a note each
    check_types(Config, overrides, legacy=LEGACY_PATHS)  # before --data / --steps replace a value of theirs
    if args.data is not None:
        overrides = merge(overrides, {"data": {"path": args.data}})
    if args.steps is not None:
        overrides = merge(overrides, {"train": {"steps": args.steps}})
    restart = torchrun_restart()
    if restart and not args.dry_run:  # torchrun's agent restarted the group after a failure: continue the run
        if not args.out:
            raise MoetrainError(f"torchrun restarted the job ({RESTART_ENV}={restart}) but the command has no --out, "
                                "so there is no run to continue; pass --out RUN_DIR with --max-restarts")
        args.resume, args.overwrite = True, False  # --overwrite was for the first start
    if args.resume and args.overwrite:  # one continues the run, the other deletes it: neither can be meant silently
        raise MoetrainError("--resume continues the run in --out and --overwrite deletes it first; pass one of them")
    file_data = upgrade(load_file(args.config)) if args.config else None
    if args.list_fields:
        from moetrain.config_docs import field_lines

        for flag, given in (("--resume", args.resume), ("--init-from", args.init_from), ("--dry-run", args.dry_run)):
            if given:
                raise MoetrainError(f"--list-fields lists a preset's fields and does not combine with {flag} (a run's "
                                    "own fields are in its config.json; --dry-run checks a config)")
        config = build_config(args.preset, file_data, overrides)
        print(f"config fields of preset {config.preset!r} (set one with FIELD=VALUE or in a --config file; "
              "each in full: docs/configuration.md)")
        print(*field_lines(config), sep="\n")
        return 0
    init = None
    if args.init_from:
        from moetrain.interop.finetune import load_init

        init = load_init(args.init_from)
    # Under torchrun only rank 0 owns the run directory (the others never write it): it alone locks and checks it.
    owner = os.environ.get("RANK", "0") == "0"

    resume, notes, changes = args.resume, [], []
    if restart and not args.dry_run:
        notes.append(f"note: torchrun restart {restart} ({RESTART_ENV}): continuing {args.out} from its newest "
                     "checkpoint that verifies, as --resume does")
    init_notes: list[str] = []  # said after the run directory's own notes
    if resume:
        if not args.out:
            raise MoetrainError("--resume needs --out RUN_DIR (the run to continue)")
        run_dir = Path(args.out)
        if not run_dir.exists():
            resume = False
            notes.append(f"note: {run_dir} does not exist yet, so there is nothing to resume: starting a new run there "
                         "(--resume continues it from its newest checkpoint next time)")
        elif _started_but_empty(run_dir):
            resume = False
            notes.append(f"note: {run_dir} has no config.json (its first run stopped before writing it, so there is "
                         "nothing to resume): starting it from step 0 with this command's settings")
        elif not (run_dir / "config.json").is_file():
            raise MoetrainError(f"--resume: {run_dir / 'config.json'} not found; is '{run_dir}' a moetrain run "
                                "directory?")
        else:
            config, changes = _resumed_config(run_dir, args, file_data, overrides)
    if not resume:
        if init is None:
            config = build_config(args.preset, file_data, overrides)
        else:
            config, init_notes = init.config(args.preset, file_data, overrides)
        check_router_trainable(config)
        check_data_path(config.data.path)
    from moetrain.parallel.dry_run import check, dry_run, too_large
    from moetrain.runtime.preflight import available_memory, check_fits
    from moetrain.train.trainer import CONFIG_FILE, resolve_device  # torch from here on

    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if not resume and world >= 1:  # a resumed run keeps its config.json's micro-batches
        from moetrain.parallel import microbatches
        from moetrain.presets import PRESETS

        if not microbatches.given(PRESETS.get(config.preset), file_data, overrides):
            config, chosen = microbatches.choose(config, world)
            if chosen:
                notes.append(f"note: {chosen}")
    if args.dry_run:  # of the config this command would train, the resumed run's included; nothing is written
        from moetrain.train.resume_config import describe

        if world < 1:
            raise MoetrainError(f"--world-size: must be >= 1, got {world}")
        if resume and changes:
            print(f"resuming would change the config: {describe(changes)}")
        if resume:
            _check_steps_cover_checkpoint(config, Path(args.out))
        print(*notes, *dry_run(config, world).lines, sep="\n")
        what = f"the resumed run {args.out}'s config" if resume else "the config"
        print(f"dry run: {what} is valid for {world} rank(s); nothing was written")
        return 0
    device_type = resolve_device(config.train.device).type  # after the dry run: it plans a GPU job on any machine
    if not resume:
        if config.preset in SHAPE_ONLY:  # the sharded state against this machine's memory (parallel/dry_run.py)
            why = too_large(config, world, device_type, available_memory(device_type))
            if why:
                raise MoetrainError(why)
        run_dir = Path(args.out) if args.out else Path("runs") / f"{config.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        check_output_path(run_dir, "--out")
    check(config, world)  # the layout --dry-run checks, before --overwrite can delete the old run
    check_fits(config, device_type, world=world)  # before any allocation or write

    had_files = run_dir.is_dir() and bool(os.listdir(run_dir))  # before the lock creates the directory and its file
    with RunLock(run_dir) if owner else contextlib.nullcontext():
        if not resume and owner and run_dir.exists():
            if _started_but_empty(run_dir):
                if not notes and had_files:
                    notes.append(f"note: {run_dir} holds only the start of a run that stopped before writing its "
                                 f"{CONFIG_FILE}: starting it again")
                _clear(run_dir)
            elif set(os.listdir(run_dir)) - {LOCK_FILE}:
                if not args.overwrite:
                    raise MoetrainError(
                        f"run directory '{run_dir}' already exists; pass --resume to continue it, --overwrite to "
                        "replace it, or choose another --out"
                    )
                if not (run_dir / CONFIG_FILE).is_file():
                    raise MoetrainError(f"--overwrite: '{run_dir}' is not a moetrain run directory (no config.json); "
                                        "refusing to delete it")
                _check_checkpoint_location(config, run_dir)
                # Prepare the data before deleting anything, so a mistyped --data or an unusable corpus (only
                # binary files, shorter than a sequence) cannot cost the old run; the trainer then hits the cache
                # and says what it holds.
                from moetrain.data.dataset import prepare_data

                prepare_data(config.data, config.model.vocab_size, tokenizer_path=init.tokenizer if init else None,
                             log=lambda _line: None)
                _clear(run_dir)
        return _train(args, config, run_dir, resume, init, notes + init_notes, changes)


def _check_steps_cover_checkpoint(config, run_dir: Path) -> None:
    """``--resume --dry-run``: the trainer's own check that ``train.steps`` reaches the newest checkpoint's step
    (without verifying the checkpoint: the dry run reads no checkpoint file).

    Raises:
        ConfigError: ``train.steps`` below the newest checkpoint's step, naming both.
    """
    from moetrain.train.checkpoint import CheckpointStore, step_of
    from moetrain.train.resume_config import require_steps_reach

    store = CheckpointStore(config.train.checkpoint_url or run_dir / "checkpoints")
    names = store.names()
    if names:
        require_steps_reach(config.train.steps, step_of(names[-1]), store.location(names[-1]), "the newest checkpoint")


def _check_checkpoint_location(config, run_dir: Path) -> None:
    """Before ``--overwrite`` deletes ``run_dir``: a ``train.checkpoint_url`` outside it that holds checkpoints
    (the old run's, most likely) would make the new run refuse to start only after the old one was gone.

    Raises:
        MoetrainError: naming the location and its newest checkpoint; nothing has been deleted.
    """
    from moetrain.train.checkpoint import CheckpointStore

    url = config.train.checkpoint_url
    if url is None:
        return
    store = CheckpointStore(url)
    if store.local and run_dir.resolve() in (Path(store.root).resolve(), *Path(store.root).resolve().parents):
        return  # inside the run directory: deleted with it
    names = store.names()
    if names:
        raise MoetrainError(f"--overwrite: train.checkpoint_url {store.url} holds checkpoints ({names[-1]} ...), "
                            "perhaps this run's own, which --overwrite does not delete; delete them or choose another "
                            f"location (nothing in '{run_dir}' was deleted)")


def _train(args, config, run_dir: Path, resume: bool, init, notes: list[str], changes: list) -> int:
    """Join the job (torchrun) and run the trainer; prints the notes, the config changes and the closing line."""
    from moetrain.parallel.comm import CollectiveError
    from moetrain.parallel.launch import start
    from moetrain.train.resume_config import describe
    from moetrain.train.trainer import Trainer, resolve_device, resume_hint

    hooks = start(config, resolve_device(config.train.device).type)  # joins torchrun's job when WORLD_SIZE > 1
    from moetrain.train.console import say as write_line

    say = write_line if hooks.is_main else (lambda *a, **k: None)  # above the progress bar when one is drawn

    def ready() -> None:  # every check passed and the run directory is written: nothing said here can be undone
        say(f"run directory: {run_dir}")
        for note in notes:
            say(note)
        if changes:
            say(f"resuming with a changed config: {describe(changes)} (config.json is rewritten with them)")

    try:
        result = Trainer(config, run_dir, resume=resume, progress=not args.no_progress and hooks.is_main,
                         init_weights=init.weights if init else None, init_tokenizer=init.tokenizer if init else None,
                         log=say, hooks=hooks, on_ready=ready).run(args.stop_at_step)
    except CollectiveError as e:  # a peer died or hung: every surviving rank says which collective, exit 1
        print(f"moetrain: error: rank {hooks.mesh.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # the allocator's failure in a step: one line with the layouts to try, exit 1
        from moetrain.runtime.preflight import out_of_memory

        line = out_of_memory(e, config, hooks.mesh.world_size)
        if line is None:
            raise
        print(f"moetrain: error: rank {hooks.mesh.rank}: {line}", file=sys.stderr, flush=True)
        return 1
    finally:
        hooks.close()
    again = resume_hint(run_dir, hooks.mesh.distributed)
    if result.preempted:
        say(f"stopped by {result.preempted} after step {result.steps} with a checkpoint; continue with: {again}")
    elif result.out_of_time:
        say(f"stopped after step {result.steps} of {config.train.steps}: train.time_budget_s="
            f"{config.train.time_budget_s:g} s ran out; evaluated and checkpointed; continue with: {again}")
    elif result.steps < config.train.steps:
        say(f"stopped after step {result.steps} of {config.train.steps} (--stop-at-step) with a checkpoint; "
            f"continue with: {again}")
    else:  # the default corpus is Python source; any other corpus gets a placeholder rather than a guess
        prompt = "'def '" if config.data.path is None else "'YOUR TEXT'"
        say(f"done: {result.steps} steps; try: moetrain generate {shlex.quote(str(run_dir))} --prompt {prompt}")
    return 0
