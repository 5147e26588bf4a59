"""What the training loop reports: the progress bar, tokens/s, the ``metrics.jsonl`` records and the log lines of
a step, apart from the loop (``train/trainer.py``). The records (docs/getting-started.md):

- at a logging step: ``step``, ``train_loss``, ``lr``, the rates of :mod:`moetrain.train.console`, ``aux_loss``,
  ``z_loss``, ``grad_norm``, ``elapsed_s``, ``val_loss`` when evaluated, then the routing monitor's and the parallel
  hooks' fields; the first of a run (not of a resume) also ``first_batch_sha256`` (:func:`batch_fingerprint`);
- before the first step of a run: ``step`` 0, ``val_loss``, ``val_sha256`` (:func:`batches_fingerprint`);
- at an evaluation step that is not a logging step: ``step``, ``val_loss``, ``elapsed_s``;
- at a skipped (non-finite) step: ``step``, ``skipped_nonfinite``, ``nonfinite_skips``.

``elapsed_s``: wall seconds from the start of this process's training loop to the end of that step, evaluations and
checkpoints included (the clock of ``train.time_budget_s``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, TypeVar

from moetrain.data.batch import Batch, model_inputs
from moetrain.train.console import Console, MfuModel, use_bar
from moetrain.train.metrics import read_records
from moetrain.train.step import StepResult

B = TypeVar("B", bound=Batch)


def batch_fingerprint(batch: Batch) -> str:
    """The first 16 hex digits of the SHA-256 of a micro-batch's input and target token ids (int64, with their
    shapes, [B, S] each): equal for the same tokens in the same order, whatever the model."""
    inputs, targets, _ = model_inputs(batch)
    h = hashlib.sha256()
    for t in (inputs, targets):
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu").long().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def batches_fingerprint(batches: Iterable[Batch]) -> str:
    """The first 16 hex digits of the SHA-256 of the :func:`batch_fingerprint` of each of ``batches``, in order:
    names a validation set (``val_sha256``), so ``moetrain eval`` can tell whether it evaluates the same tokens."""
    return hashlib.sha256("".join(batch_fingerprint(b) for b in batches).encode()).hexdigest()[:16]


def logged_val_fingerprint(run_dir: Path) -> str | None:
    """The ``val_sha256`` that ``RUN_DIR/metrics.jsonl`` holds from before the first step (None: a run older than
    the field, or no readable record)."""
    records = read_records(Path(run_dir) / "metrics.jsonl")[0]
    found = next((r.get("val_sha256") for r in records if r["step"] == 0 and "val_sha256" in r), None)
    return found if isinstance(found, str) else None


class StepLog:
    """The loop's reporting (rank 0's ``metrics`` writes; the other ranks get a null writer).

    Args:
        metrics: a ``MetricsLogger`` (or ``NullMetrics``): ``log(record)``, ``writer``, ``close()``.
        log: prints one line.
        total_steps: the progress bar's length.
        initial_step: the progress bar's start (a resumed run starts past 0).
        tokens_per_step: tokens of one optimizer step over all ranks (batch x grad_accum x seq_len).
        progress: show the progress bar (on a terminal; else plain lines, see :mod:`moetrain.train.console`).
        mfu: the FLOPs model for ``mfu`` (:func:`moetrain.train.console.mfu_model`), or ``None``.
    """

    def __init__(self, metrics: Any, log: Callable[[str], None], total_steps: int, initial_step: int,
                 tokens_per_step: int, progress: bool, mfu: MfuModel | None = None):
        self.metrics, self.log = metrics, log
        self.console = Console(total_steps, initial_step, tokens_per_step, mfu, use_bar(progress), log)
        self.t0 = time.perf_counter()
        self.elapsed_s = 0.0  # at the end of the latest step (see the module docstring)
        self.last_step = total_steps  # the step whose validation line the trainer's closing line prints instead
        self.first_batch: str | None = None  # batch_fingerprint of the first micro-batch, until it is logged

    def fingerprinted(self, next_batch: Callable[[], B]) -> Callable[[], B]:
        """``next_batch`` whose first micro-batch's :func:`batch_fingerprint` goes into the next logging record."""
        seen = False

        def wrapper() -> B:
            nonlocal seen
            batch = next_batch()
            if not seen:
                seen, self.first_batch = True, batch_fingerprint(batch)
            return batch

        return wrapper

    def step(self, loss: float, lr: float) -> None:
        """One optimizer step done (``loss``: its LM loss)."""
        self.console.step(loss, lr)
        self.elapsed_s = time.perf_counter() - self.t0

    def skipped(self, step: int, result: StepResult, loss: float, total: int, in_a_row: int, limit: int) -> None:
        """A step whose update was skipped for a non-finite loss or gradient norm."""
        self.log(f"warning: step {step}: non-finite loss ({loss}) or gradient norm "
                 f"({float(result.grad_norm)}): update skipped ({in_a_row} in a row, "
                 f"{total} in total; train.max_nonfinite_skips={limit})")
        self.metrics.log({"step": step, "skipped_nonfinite": True, "nonfinite_skips": total})

    def train_record(self, step: int, result: StepResult, loss: float) -> dict[str, Any]:
        """The logging step's record so far (the caller adds ``val_loss`` and monitor fields, then
        :meth:`write`); tokens/s, mfu and data_wait_s count the steps since the previous logging step."""
        record: dict[str, Any] = {
            "step": step, "train_loss": loss, "lr": result.lr, **self.console.logging_step(loss, result.lr),
            "aux_loss": float(result.moe_losses["aux_loss"]), "z_loss": float(result.moe_losses["z_loss"]),
            "grad_norm": float(result.grad_norm),
            "elapsed_s": self.elapsed_s}
        if self.first_batch is not None:
            record["first_batch_sha256"], self.first_batch = self.first_batch, None
        return record

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.log(record)
        if "val_loss" in record:
            self._val_line(record["step"], record["val_loss"])

    def val(self, step: int, val_loss: float) -> None:
        """An evaluation at a step that is not a logging step."""
        self.metrics.log({"step": step, "val_loss": val_loss, "elapsed_s": self.elapsed_s})
        self._val_line(step, val_loss)

    def _val_line(self, step: int, val_loss: float) -> None:
        if step < self.last_step:  # the last one is in the trainer's closing line
            self.log(f"step {step}: val_loss {val_loss:.4f}")

    def close(self, summary: bool = True) -> None:
        """Close the bar; then, if ``summary`` and steps were run, the summary line (wall time, mean tokens/s, MFU).
        The trainer passes ``summary=False`` when an error ends the run, so that its last lines are the error's, not
        a line that reads like success."""
        self.console.close()
        if summary and self.console.step_no > self.console.initial:
            self.log(self.console.summary())
