"""Validation loss file by file: which held-out documents a run (or a pair of runs) does well or badly on.

For each run directory given, loads the newest checkpoint (``moetrain.commands.run_dir.load_run``), rebuilds the
run's own validation split (``data.path`` and ``data.val_fraction`` from its config, the same file reader and
split as training: ``moetrain.data.corpus``), tokenizes each held-out document with the run's tokenizer and scores
every next-token prediction in it, in consecutive windows of ``data.seq_len`` tokens. Prints one row per document
(tokens, mean loss in nats per token for each run), then each run's token-weighted mean over all documents and
without the single largest one.

Used in docs/moe-vs-dense.md (wave 8) to find that the Pygments corpus's held-out split is three quarters one
generated file, on which the MoE and its twin differ most. Training evaluates only the first ``train.eval_batches``
batches of the split; this scores all of it, so the figures differ from the training log's. Asserts nothing.

Usage: ``python benchmarks/val_by_file.py RUN_DIR [RUN_DIR ...]`` (runs trained on the same data and tokenizer
settings; the documents are listed in split order). ``--tokens NAME --top N`` adds, for the held-out document whose
name contains NAME, the N target tokens on which the last run loses most to the first (summed over the document's
occurrences): occurrences, each run's mean loss on them, their share of the document's mean difference, and each
run's two most frequent top-1 predictions there. Used in docs/moe-vs-dense.md to find that one token of Pygments'
``lexers/_mapping.py`` carries most of the MoE's deficit there. ``--files PATH ... [--max-tokens N]`` scores the
given files (their first N predictions) instead of the held-out split: text none of the runs trained on, such as
another package's generated tables (wave 9's out-of-distribution check).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch

from moetrain.commands.run_dir import load_run
from moetrain.data import discover_files
from moetrain.data.corpus import Document, read_documents, split_documents


@torch.no_grad()
def doc_loss(model: torch.nn.Module, ids: list[int], seq_len: int) -> tuple[float, int]:
    """Summed next-token loss of one document.

    Args:
        model: a :class:`~moetrain.model.transformer.MoETransformer` in eval mode.
        ids: the document's token ids (int), at least 2 for any prediction.
        seq_len: window length; the document is cut into consecutive windows of up to ``seq_len`` predictions.
    Returns:
        (summed loss in nats, number of predictions); the model's own LM loss (its ``lm_loss``, the mean the
        trainer's ``evaluate`` uses) times each window's predictions.
    """
    total, count = 0.0, 0
    tokens = torch.tensor(ids, dtype=torch.long)
    for start in range(0, len(ids) - 1, seq_len):
        targets = tokens[start + 1 : start + 1 + seq_len]  # [S] int64
        inputs = tokens[start : start + targets.numel()]  # [S] int64
        out = model(inputs[None], targets[None], return_logits=False)
        total += float(out.lm_loss) * targets.numel()
        count += targets.numel()
    return total, count


@torch.no_grad()
def token_losses(model: torch.nn.Module, ids: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prediction loss and top-1 prediction over one document, in windows as :func:`doc_loss`.

    Returns:
        ``(loss, argmax)``: ``[len(ids) - 1]`` float32 nats (cross-entropy of the fp32 logits) and int64 token ids.
    """
    tokens = torch.tensor(ids, dtype=torch.long)
    losses, argmax = [], []
    for start in range(0, len(ids) - 1, seq_len):
        targets = tokens[start + 1 : start + 1 + seq_len]  # [S]
        logits = model(tokens[start : start + targets.numel()][None], targets[None], return_logits=True).logits
        logp = torch.log_softmax(logits[0].float(), dim=-1)  # [S, V]
        losses.append(-logp.gather(-1, targets[:, None])[:, 0])
        argmax.append(logp.argmax(-1))
    return torch.cat(losses), torch.cat(argmax)


def print_token_table(runs: list, labels: list[str], doc, top: int, max_tokens: int = 0) -> None:
    """The ``--tokens`` table for one document (see the module docstring; ``max_tokens`` as ``--max-tokens``)."""
    tokenizer = runs[0].tokenizer
    ids = tokenizer.encode(doc.text).ids[: max_tokens + 1 if max_tokens > 0 else None]
    per_run = [token_losses(run.model, ids, run.config.data.seq_len) for run in runs]
    targets = torch.tensor(ids[1:])
    diff = per_run[-1][0] - per_run[0][0]  # last run minus first, per prediction
    print(f"\n{doc.name}: {len(targets)} predictions, mean loss "
          + ", ".join(f"{lab} {loss.mean():.3f}" for lab, (loss, _) in zip(labels, per_run))
          + f"; {labels[-1]} - {labels[0]} = {diff.mean():+.3f}")
    sums = torch.zeros(tokenizer.get_vocab_size()).index_add_(0, targets, diff)
    print("| target token | occurrences | " + " | ".join(f"{lab} loss" for lab in labels)
          + " | share of the difference | " + " | ".join(f"{lab} predicts" for lab in labels) + " |")
    print("|---|---|" + "---|" * (2 * len(labels) + 1))
    for tok in sums.argsort(descending=True)[:top].tolist():
        where = targets == tok
        common = [Counter(argmax[where].tolist()).most_common(2) for _, argmax in per_run]
        preds = [", ".join(f"{tokenizer.id_to_token(p)!r} x{n}" for p, n in pairs) for pairs in common]
        print(f"| {tokenizer.id_to_token(tok)!r} | {int(where.sum())} | "
              + " | ".join(f"{loss[where].mean():.2f}" for loss, _ in per_run)
              + f" | {float(sums[tok]) / len(targets):+.3f} | "
              + " | ".join(preds) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument("--tokens", metavar="NAME",
                        help="the per-token table for the first scored document whose name contains NAME")
    parser.add_argument("--top", type=int, default=10, help="rows of the per-token table (default 10)")
    parser.add_argument("--files", nargs="+", metavar="PATH",
                        help="score these files instead of the held-out split (text none of the runs trained on)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="score at most this many predictions of each document (default 0: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scores: dict[str, dict[str, tuple[float, int]]] = {}
    loaded = []
    val = None  # the held-out documents, read once from the first run's config (the runs share their data)
    for run_dir in args.runs:
        run = load_run(run_dir)
        loaded.append(run)
        if val is None and args.files:
            val = [Document("/".join(Path(f).parts[-2:]), Path(f).read_text(encoding="utf-8")) for f in args.files]
        elif val is None:
            docs, _ = read_documents(discover_files(run.config.data.path))
            _, val = split_documents(docs, run.config.data.val_fraction)
        limit = args.max_tokens + 1 if args.max_tokens > 0 else None
        scores[run_dir] = {d.name: doc_loss(run.model, run.tokenizer.encode(d.text).ids[:limit],
                                            run.config.data.seq_len) for d in val}
    names = [d.name for d in val or []]
    labels = [Path(r).name for r in args.runs]
    print("| file | tokens | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for name in names:
        _, n = scores[args.runs[0]][name]
        print(f"| {name} | {n} | " + " | ".join(f"{scores[r][name][0] / n:.3f}" for r in args.runs) + " |")
    largest = max(names, key=lambda name: scores[args.runs[0]][name][1])
    for run_dir, label in zip(args.runs, labels):
        s = scores[run_dir]
        total, n = sum(v[0] for v in s.values()), sum(v[1] for v in s.values())
        rest = [v for k, v in s.items() if k != largest]
        print(f"{label}: all {total / n:.3f} over {n} predictions; without {largest}: "
              f"{sum(v[0] for v in rest) / sum(v[1] for v in rest):.3f}")
    if args.tokens:
        matches = [d for d in val or [] if args.tokens in d.name]
        if not matches:
            raise SystemExit(f"--tokens {args.tokens}: no scored document's name contains it")
        print_token_table(loaded, labels, matches[0], args.top, args.max_tokens)


if __name__ == "__main__":
    main()
