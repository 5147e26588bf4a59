"""The validation-coverage note (data/val_coverage.py): document shares counted by hand, and the note a run prints
when one held-out document dominates the evaluated tokens."""

from __future__ import annotations

import numpy as np

from moetrain.data.val_coverage import DocumentShare, largest_document, val_coverage_note

EOS = 0


def _stream(*lengths: int) -> np.ndarray:
    """Documents of the given lengths (EOS included), each of tokens 1..length-1 then EOS."""
    return np.concatenate([np.append(np.arange(1, n), EOS) for n in lengths])


def test_documents_are_cut_at_the_eos_that_closes_them():
    assert largest_document(_stream(3, 5, 2), EOS) == DocumentShare(largest=5, evaluated=10, documents=3)
    # a span that ends inside a document counts that document's part; no EOS at all is one document
    assert largest_document(_stream(3, 5, 2)[:6], EOS) == DocumentShare(largest=3, evaluated=6, documents=2)
    assert largest_document(np.array([4, 5, 6]), EOS) == DocumentShare(3, 3, 1)
    assert largest_document(np.array([], dtype=np.int64), EOS).share == 0.0


def test_a_note_only_when_one_document_is_more_than_half_of_what_is_evaluated():
    # the validation stream: the first token is only an input; then documents of 40, 200 and 60 tokens
    val = np.concatenate([[7], _stream(40, 200, 60)])
    # 2 windows of 100 predict tokens 1..200: 40 of the first document, 160 of the second (80%)
    note = val_coverage_note(val, EOS, evaluated_windows=2, seq_len=100, val_documents=3, batch_size=1)
    assert note == ("data: note: one held-out document is 80% of the 200 validation tokens evaluated (2 of 3 "
                    "documents; the split has 301 tokens, end-of-text tokens included), so val_loss mostly measures "
                    "that document; train.eval_batches=3 evaluates all 3 full batches of the split")
    # all three windows: 200 of 300 (67%), still a note, with nothing more to evaluate; batches of 2 windows: one
    # full batch (2 windows), so 2 windows are everything eval_batches can give
    assert val_coverage_note(val, EOS, 3, 100, 3, 1) == (
        "data: note: one held-out document is 67% of the 300 validation tokens evaluated (3 of 3 documents; the split "
        "has 301 tokens, end-of-text tokens included), so val_loss mostly measures that document; that is the whole "
        "split (the full batches of it)")
    assert val_coverage_note(val, EOS, 2, 100, 3, 2).endswith("that is the whole split (the full batches of it)")
    # a balanced split, or a one-document split, gets none
    balanced = np.concatenate([[7], _stream(100, 100, 100)])
    assert val_coverage_note(balanced, EOS, 3, 100, 3, 1) is None
    assert val_coverage_note(np.concatenate([[7], _stream(300)]), EOS, 3, 100, 1, 1) is None
