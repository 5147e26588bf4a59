"""``moetrain eval RUN_DIR [--data PATH] [--batches N]``: validation loss and perplexity of a trained run.

By default it evaluates exactly what training's periodic evaluation did (the run's validation split, its
``train.eval_batches`` batches, its ``train.dtype``), so on the newest checkpoint it reproduces the run's last logged
``val_loss``, and says so when the run logged one at that checkpoint's step.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moetrain.commands import check_at_least
from moetrain.commands.run_dir import load_run
from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="validation loss and perplexity of a trained run")
    e.add_argument("run_dir")
    e.add_argument("--data", help="evaluate on this data's validation split instead of the run's")
    e.add_argument("--batches", type=int, default=None,
                   help="validation micro-batches (default: the run's train.eval_batches, as during training)")
    e.set_defaults(func=run)


def logged_val_loss(run_dir: Path, step: int) -> float | None:
    """The last ``val_loss`` that ``RUN_DIR/metrics.jsonl`` holds for ``step`` (None if none or unreadable, or if that
    last one is not a number: training writes a non-finite loss as ``null``); read by report/runlog.py, which skips
    lines torn by a crash."""
    from moetrain.report.runlog import load_run_log

    try:
        records = load_run_log(run_dir).records
    except MoetrainError:  # neither metrics.jsonl nor config.json
        return None
    found = next((r["val_loss"] for r in reversed(records) if r["step"] == step and "val_loss" in r), None)
    return float(found) if isinstance(found, (int, float)) and not isinstance(found, bool) else None


def evaluated_alike(saved: dict | None, config) -> bool:
    """Whether ``saved``, the config.json inside a checkpoint (what training had when it wrote that checkpoint and
    its records), evaluated with ``config``'s settings (data, ``train.batch_size``, ``eval_batches``, ``dtype``): a
    later resume with other overrides rewrites RUN_DIR/config.json but not the records and checkpoints before it."""

    def settings(c):
        train = c.get("train") if isinstance(c, dict) else None
        if not isinstance(train, dict):
            return None
        return c.get("data"), train.get("batch_size"), train.get("eval_batches"), train.get("dtype")

    now = settings(config.to_dict())  # plain JSON data, as the checkpoint's config.json reads
    return now is not None and settings(saved) == now


def run(args) -> int:
    import dataclasses
    import math

    from moetrain.data.batch import model_inputs
    from moetrain.data.dataset import prepare_data
    from moetrain.data.loader import validation_batches
    from moetrain.train.progress import batches_fingerprint, logged_val_fingerprint
    from moetrain.train.trainer import TOKENIZER_FILE, evaluate

    check_at_least(args, 1, "batches")
    if args.data is not None and not args.data.strip():
        raise MoetrainError(f"--data: is empty ({args.data!r}); give a file, directory or glob, or leave --data out "
                            "for the run's own data")
    config, _, model, ckpt = load_run(args.run_dir)
    n_batches = config.train.eval_batches if args.batches is None else args.batches
    data_cfg = config.data if args.data is None else dataclasses.replace(config.data, path=args.data)
    data = prepare_data(data_cfg, config.model.vocab_size, tokenizer_path=Path(args.run_dir) / TOKENIZER_FILE,
                        log=lambda m: print(m, file=sys.stderr))
    t = config.train
    # The validation batches training built: packed documents with data.packing=documents, else windows.
    batches, _ = validation_batches(data, data_cfg.seq_len, data_cfg.packing, t.batch_size, n_batches, t.seed)
    loss = evaluate(model, batches, next(model.parameters()).device, t.dtype)
    step = ckpt.step
    rows, width = model_inputs(batches[0])[0].shape  # [B, S]
    try:
        perplexity = math.exp(loss)
    except OverflowError:  # a diverged model: loss above ~709.8 nats
        perplexity = math.inf
    print(f"val_loss {loss:.4f}  perplexity {perplexity:.2f}  ({len(batches)} batches of {rows} x {width} tokens, "
          f"{t.dtype}, checkpoint step {step})")
    same_set = args.data is None and n_batches == config.train.eval_batches and evaluated_alike(ckpt.config, config)
    logged = logged_val_loss(Path(args.run_dir), step) if same_set else None
    if logged is not None:
        # The config alone cannot tell: the corpus files may have been edited since training.
        if logged_val_fingerprint(Path(args.run_dir)) in (None, batches_fingerprint(batches)):
            print(f"training logged val_loss {logged:.4f} at step {step} on the same batches")
        else:
            print(f"training logged val_loss {logged:.4f} at step {step}, but these validation batches differ from "
                  "those training evaluated (the corpus changed since)")
    return 0
