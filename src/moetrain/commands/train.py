"""``moetrain train``: train a model (default: the cpu-small preset on the Python standard-library corpus)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from moetrain.configlib import load_file, merge, parse_overrides
from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (default: the cpu-small preset on the Python stdlib corpus)")
    p.add_argument("--preset", help="tiny | cpu-small (default) | mixtral-8x7b | qwen3-30b-a3b | olmoe-1b-7b")
    p.add_argument("--config", help="a .toml or .json file of config fields (applied over the preset)")
    p.add_argument("--data", help="text file, directory, glob or .jsonl; default: the Python standard library")
    p.add_argument("--out", help="run directory (default: runs/PRESET-TIMESTAMP)")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete an existing --out directory first")
    p.add_argument("--stop-at-step", type=int, help="stop (with a checkpoint) after this step; --resume continues")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--init-from", metavar="HF_DIR",
                   help="fine-tune a Hugging Face checkpoint: model and tokenizer from HF_DIR (see export, upcycle)")
    p.add_argument("overrides", nargs="*", metavar="FIELD=VALUE", help="e.g. model.moe.top_k=1 train.lr=1e-3")
    p.set_defaults(func=run)


def run(args) -> int:
    from moetrain.config import Config, build_config
    from moetrain.train.trainer import CONFIG_FILE, Trainer

    overrides = parse_overrides(args.overrides)
    if args.data is not None:
        overrides = merge(overrides, {"data": {"path": args.data}})
    if args.steps is not None:
        overrides = merge(overrides, {"train": {"steps": args.steps}})
    file_data = load_file(args.config) if args.config else None
    init = None
    if args.init_from:
        from moetrain.interop.finetune import load_init

        init = load_init(args.init_from)

    if args.resume:
        if not args.out:
            raise MoetrainError("--resume needs --out RUN_DIR (the run to continue)")
        run_dir = Path(args.out)
        saved = run_dir / CONFIG_FILE
        if not saved.is_file():
            raise MoetrainError(f"--resume: {saved} not found; is '{run_dir}' a moetrain run directory?")
        if args.preset:
            raise MoetrainError("--preset cannot be combined with --resume (the run keeps its own config)")
        try:
            data = json.loads(saved.read_text())
        except (OSError, ValueError) as e:
            raise MoetrainError(f"--resume: cannot read {saved}: {e}") from None
        if not isinstance(data, dict):
            raise MoetrainError(f"--resume: {saved} is not a JSON object of config fields")
        data = merge(data, file_data or {})
        config = Config.from_dict(merge(data, overrides))
    else:
        if init is None:
            config = build_config(args.preset, file_data, overrides)
        else:
            config = init.config(args.preset, file_data, overrides)
        run_dir = Path(args.out) if args.out else Path("runs") / f"{config.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
        if run_dir.exists() and not run_dir.is_dir():
            raise MoetrainError(f"--out {run_dir}: exists and is not a directory")
        if any(p.exists() and not p.is_dir() for p in run_dir.parents):
            raise MoetrainError(f"--out {run_dir}: a parent path is a file, not a directory")
        # Under torchrun only rank 0 owns the run directory (the others never write it).
        if os.environ.get("RANK", "0") == "0" and run_dir.exists() and any(run_dir.iterdir()):
            if not args.overwrite:
                raise MoetrainError(
                    f"run directory '{run_dir}' already exists; pass --resume to continue it, --overwrite to "
                    "replace it, or choose another --out"
                )
            if not (run_dir / "config.json").is_file():
                raise MoetrainError(f"--overwrite: '{run_dir}' is not a moetrain run directory (no config.json); "
                                    "refusing to delete it")
            # Check the data before deleting anything, so a mistyped --data cannot cost the old run.
            from moetrain.data.corpus import discover_files

            discover_files(config.data.path)
            shutil.rmtree(run_dir)
    from moetrain.parallel.comm import CollectiveError
    from moetrain.parallel.launch import start
    from moetrain.train.trainer import resolve_device

    hooks = start(config, resolve_device(config.train.device).type)  # joins torchrun's job when WORLD_SIZE > 1
    say = print if hooks.is_main else (lambda *a, **k: None)
    say(f"run directory: {run_dir}")
    try:
        result = Trainer(config, run_dir, resume=args.resume, progress=not args.no_progress and hooks.is_main,
                         init_weights=init.weights if init else None,
                         init_tokenizer=init.tokenizer if init else None, log=say, hooks=hooks).run(args.stop_at_step)
    except CollectiveError as e:  # a peer died or hung: every surviving rank says which collective, exit 1
        print(f"moetrain: error: rank {hooks.mesh.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        hooks.close()
    if result.preempted:
        say(f"stopped by {result.preempted} after step {result.steps} with a checkpoint; continue with: "
            f"moetrain train --out {run_dir} --resume")
        return 0
    say(f"done: {result.steps} steps; try: moetrain generate {run_dir} --prompt 'def '")
    return 0
