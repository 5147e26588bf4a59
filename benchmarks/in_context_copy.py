"""Does a trained model copy from its context? The repeated-random-tokens test of induction heads.

Feeds each run ``--sequences`` sequences of ``--length`` token ids drawn uniformly (a fixed generator, seed 0) from
the vocabulary above id 300 (past the byte alphabet and the specials), each followed by an exact copy of itself, and
prints the mean next-token loss (nats) over the first copy and over the second. A model with induction heads
(Olsson et al. 2022, "In-context learning and induction heads") predicts the second copy from the first, so its
second-copy loss falls far below the first's (towards 0); a model without them scores both copies alike, near
ln(vocab). Used in docs/moe-vs-dense.md (wave 9) to rule out in-context copying as the difference between an MoE
and its dense twin on a held-out table whose entries repeat. Asserts nothing.

Usage: ``python benchmarks/in_context_copy.py RUN_DIR [RUN_DIR ...] [--length 100] [--sequences 32]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moetrain.commands.run_dir import load_run


@torch.no_grad()
def copy_losses(model: torch.nn.Module, vocab_size: int, length: int, sequences: int) -> tuple[float, float]:
    """Mean next-token loss over the first copy and over the second.

    Args:
        model: a :class:`~moetrain.model.transformer.MoETransformer` in eval mode, context >= ``2 * length``.
        vocab_size: the model's vocabulary (ids drawn from ``[300, vocab_size)``).
        length: tokens per copy.
        sequences: batch of independent sequences.
    Returns:
        ``(first, second)`` in nats per token: predictions of positions 1..length-1 and length+1..2*length-1 (the
        first token of the second copy follows the end of the first and is left out of both).
    """
    generator = torch.Generator().manual_seed(0)
    half = torch.randint(300, vocab_size, (sequences, length), generator=generator)  # [B, L] int64
    tokens = torch.cat([half, half], dim=1)  # [B, 2L]
    logits = model(tokens[:, :-1], tokens[:, 1:], return_logits=True).logits.float()  # [B, 2L-1, V]
    nll = -torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]  # [B, 2L-1]
    return float(nll[:, : length - 1].mean()), float(nll[:, length:].mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument("--length", type=int, default=100, help="tokens per copy (default 100)")
    parser.add_argument("--sequences", type=int, default=32, help="sequences (default 32)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| run | first copy | second copy | second - first |")
    print("|---|---|---|---|")
    for run_dir in args.runs:
        run = load_run(run_dir)
        if 2 * args.length > run.config.model.max_seq_len or run.config.model.vocab_size <= 300:
            raise SystemExit(f"{run_dir}: needs 2 x --length <= model.max_seq_len ({run.config.model.max_seq_len}) "
                             f"and model.vocab_size > 300 ({run.config.model.vocab_size})")
        first, second = copy_losses(run.model, run.config.model.vocab_size, args.length, args.sequences)
        print(f"| {Path(run_dir).name} | {first:.2f} | {second:.2f} | {second - first:+.2f} |")


if __name__ == "__main__":
    main()
