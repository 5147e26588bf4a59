"""``moetrain generate RUN_DIR --prompt TEXT``: sample text from a trained run."""

from __future__ import annotations

import math

from moetrain.commands.run_dir import load_run
from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("run_dir")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to add (default: 200, capped at the room left in the model's context)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, in (0, 1] (default: 0.95)")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=run)


def run(args) -> int:
    import torch

    from moetrain.data.tokenizer import EOS_TOKEN
    from moetrain.model.generate import generate

    if not -(2**63) <= args.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise MoetrainError(f"--seed: must be in [-2**63, 2**64), got {args.seed}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):  # NaN fails both; inf samples uniformly
        raise MoetrainError(f"--temperature: must be finite and >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:  # also rejects NaN
        raise MoetrainError(f"--top-p: must be in (0, 1], got {args.top_p}")
    config, tokenizer, model, _ = load_run(args.run_dir)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise MoetrainError("--prompt: empty prompt")
    gen = torch.Generator().manual_seed(args.seed)
    max_new = args.max_new_tokens
    if max_new is None:
        max_new = max(0, min(200, config.model.max_seq_len - len(ids)))
    try:
        out = generate(model, torch.tensor([ids]), max_new, args.temperature, args.top_p,
                       eos_id=tokenizer.token_to_id(EOS_TOKEN), generator=gen)
    except ValueError as e:
        raise MoetrainError(str(e)) from None
    print(tokenizer.decode(out[0].tolist()))
    return 0
