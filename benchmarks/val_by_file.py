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
settings; the documents are listed in split order).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moetrain.commands.run_dir import load_run
from moetrain.data import discover_files
from moetrain.data.corpus import read_documents, split_documents


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scores: dict[str, dict[str, tuple[float, int]]] = {}
    val = None  # the held-out documents, read once from the first run's config (the runs share their data)
    for run_dir in args.runs:
        run = load_run(run_dir)
        if val is None:
            docs, _ = read_documents(discover_files(run.config.data.path))
            _, val = split_documents(docs, run.config.data.val_fraction)
        scores[run_dir] = {d.name: doc_loss(run.model, run.tokenizer.encode(d.text).ids, run.config.data.seq_len)
                           for d in val}
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


if __name__ == "__main__":
    main()
