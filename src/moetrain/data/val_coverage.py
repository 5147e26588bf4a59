"""What the validation loss measures: how much of the evaluated tokens (the first ``train.eval_batches`` batches of
the validation split, in stream order) one held-out document makes up, with ``data.packing=windows`` (why it
matters, with the Pygments example: docs/data.md, "The validation split and what val_loss measures").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A note is printed when one document makes up more than this share of the evaluated tokens.
DOMINANT_SHARE = 0.5


@dataclass(frozen=True)
class DocumentShare:
    """The largest document among the evaluated tokens.

    Attributes:
        largest: tokens of the largest document (its closing EOS included) among the evaluated ones.
        evaluated: tokens evaluated (predictions).
        documents: documents they touch (a document cut by the end of the span counts).
    """

    largest: int
    evaluated: int
    documents: int

    @property
    def share(self) -> float:
        """``largest / evaluated`` (0 when nothing is evaluated)."""
        return self.largest / self.evaluated if self.evaluated else 0.0


def largest_document(targets: np.ndarray, eos_id: int) -> DocumentShare:
    """Split a run of target tokens at the EOS that closes each document and find the longest part.

    Args:
        targets: [N] integer token ids, the predictions evaluated, in stream order (each document is followed by
            ``eos_id``, as :func:`~moetrain.data.dataset.prepare_data` writes the streams).
        eos_id: the EOS token id.
    Returns:
        The :class:`DocumentShare`; an EOS is counted with the document it closes.
    """
    n = len(targets)
    ends = np.flatnonzero(np.asarray(targets) == eos_id) + 1  # exclusive end of each closed document
    if n and (len(ends) == 0 or ends[-1] != n):
        ends = np.append(ends, n)  # the last document runs past the span
    lengths = np.diff(np.concatenate([[0], ends]))
    return DocumentShare(int(lengths.max()) if n else 0, n, len(lengths))


def val_coverage_note(val_tokens: np.ndarray, eos_id: int, evaluated_windows: int, seq_len: int,
                      val_documents: int, batch_size: int) -> str | None:
    """One log line when a single held-out document dominates what the validation loss measures, else ``None``.

    Args:
        val_tokens: [N] the validation stream.
        eos_id: its EOS id.
        evaluated_windows: windows of ``seq_len`` predictions evaluated (``train.eval_batches`` batches' rows).
        seq_len: ``data.seq_len``.
        val_documents: documents in the validation split (a one-document split gets no note).
        batch_size: ``train.batch_size`` (to say how many batches would cover the split).
    Returns:
        ``"data: note: ..."`` naming the share, the evaluated and total tokens and, when more full batches exist,
        the ``train.eval_batches`` that evaluates all of them; ``None`` when the share is at most
        :data:`DOMINANT_SHARE`.
    """
    n = evaluated_windows * seq_len
    found = largest_document(val_tokens[1 : 1 + n], eos_id)  # window i predicts tokens[i*S + 1 : i*S + S + 1]
    if val_documents < 2 or found.share <= DOMINANT_SHARE:
        return None
    full = ((len(val_tokens) - 1) // seq_len) // batch_size  # eval_batches evaluates full batches only
    advice = (f"train.eval_batches={full} evaluates all {full} full batches of the split" if full * batch_size >
              evaluated_windows else "that is the whole split (the full batches of it)")
    return (f"data: note: one held-out document is {found.share:.0%} of the {found.evaluated:,} validation tokens "
            f"evaluated ({found.documents} of {val_documents} documents; the split has {len(val_tokens):,} tokens, "
            f"end-of-text tokens included), so val_loss mostly measures that document; {advice}")


def small_split_warning(val_tokens: int, val_documents: int, rows: int, batch_size: int, count: int,
                        seq_len: int) -> str | None:
    """One log line when the validation split gives fewer than ``count * batch_size`` rows (the evaluation
    ``train.eval_batches`` asks for), so that ``val_loss`` averages fewer tokens than the run meant, else ``None``.

    Args:
        val_tokens: tokens in the validation split (end-of-text tokens included).
        val_documents: documents in it.
        rows: rows (windows or packed rows) the evaluation got.
        batch_size / count / seq_len: ``train.batch_size``, ``train.eval_batches``, ``data.seq_len``.
    Returns:
        ``"data: warning: ..."`` naming the split's size and what to change; ``None`` when the evaluation is full.
    """
    wanted = count * batch_size
    if rows >= wanted:
        return None
    docs = f"{val_documents} document" + ("" if val_documents == 1 else "s")
    return (f"data: warning: the validation split is small: {val_tokens:,} tokens in {docs}, "
            f"{rows} rows of {seq_len} tokens where train.eval_batches={count} x train.batch_size={batch_size} = "
            f"{wanted} were asked for, so val_loss is measured on {rows * seq_len:,} tokens only and is noisy; raise "
            f"data.val_fraction or add documents (or lower train.eval_batches to silence this)")
