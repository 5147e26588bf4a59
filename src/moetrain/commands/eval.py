"""``moetrain eval RUN_DIR [--data PATH]``: validation loss and perplexity of a trained run."""

from __future__ import annotations

import sys
from pathlib import Path

from moetrain.commands.run_dir import load_run
from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="validation loss and perplexity of a trained run")
    e.add_argument("run_dir")
    e.add_argument("--data", help="evaluate on this data's validation split instead of the run's")
    e.add_argument("--batches", type=int, default=32, help="validation micro-batches (default 32)")
    e.set_defaults(func=run)


def run(args) -> int:
    import dataclasses
    import math

    from moetrain.data.dataset import TokenWindows, eval_batches, prepare_data
    from moetrain.train.trainer import TOKENIZER_FILE, evaluate

    if args.batches < 1:
        raise MoetrainError(f"--batches must be >= 1, got {args.batches}")
    config, _, model = load_run(args.run_dir)
    data_cfg = config.data if args.data is None else dataclasses.replace(config.data, path=args.data)
    data = prepare_data(data_cfg, config.model.vocab_size, tokenizer_path=Path(args.run_dir) / TOKENIZER_FILE,
                        log=lambda m: print(m, file=sys.stderr))
    batches = eval_batches(TokenWindows(data.val_tokens, data_cfg.seq_len), config.train.batch_size, args.batches)
    loss = evaluate(model, batches, next(model.parameters()).device, "fp32")
    print(f"val_loss {loss:.4f}  perplexity {math.exp(loss):.2f}")
    return 0
