"""What the training loop reports: the progress bar, tokens/s, the ``metrics.jsonl`` records and the log lines of
a step. Kept apart from the loop (``train/trainer.py``) so that the output can change without touching it.

Records written (one JSON object per line, see :class:`~moetrain.train.metrics.MetricsLogger`):

- at a logging step: ``step``, ``train_loss``, ``lr``, ``tokens_per_s`` (since the previous logging step),
  ``aux_loss``, ``z_loss``, ``grad_norm``, ``mfu``, ``data_wait_s`` (see :mod:`moetrain.train.console`),
  ``val_loss`` when evaluated at that step, then the routing monitor's
  and the parallel hooks' fields;
- at an evaluation step that is not a logging step: ``step``, ``val_loss``;
- at a skipped (non-finite) step: ``step``, ``skipped_nonfinite``, ``nonfinite_skips``.
"""

from __future__ import annotations

from typing import Any, Callable

from moetrain.train.console import Console, MfuModel, use_bar
from moetrain.train.step import StepResult


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
        self.metrics, self.log, self.tokens_per_step = metrics, log, tokens_per_step
        self.console = Console(total_steps, initial_step, tokens_per_step, mfu, use_bar(progress), log)

    def step(self, loss: float, lr: float) -> None:
        """One optimizer step done (``loss``: its LM loss)."""
        self.console.step(loss, lr)

    def skipped(self, step: int, result: StepResult, loss: float, total: int, in_a_row: int, limit: int) -> None:
        """A step whose update was skipped for a non-finite loss or gradient norm."""
        self.log(f"warning: step {step}: non-finite loss ({loss}) or gradient norm "
                 f"({float(result.grad_norm)}): update skipped ({in_a_row} in a row, "
                 f"{total} in total; train.max_nonfinite_skips={limit})")
        self.metrics.log({"step": step, "skipped_nonfinite": True, "nonfinite_skips": total})

    def train_record(self, step: int, result: StepResult, loss: float) -> dict[str, Any]:
        """The logging step's record so far (the caller adds ``val_loss`` and monitor fields, then
        :meth:`write`); tokens/s, mfu and data_wait_s count the steps since the previous logging step."""
        return {"step": step, "train_loss": loss, "lr": result.lr, **self.console.logging_step(loss, result.lr),
                "aux_loss": float(result.aux_loss), "z_loss": float(result.z_loss),
                "grad_norm": float(result.grad_norm)}

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.log(record)
        if "val_loss" in record:
            self._val_line(record["step"], record["val_loss"])

    def val(self, step: int, val_loss: float) -> None:
        """An evaluation at a step that is not a logging step."""
        self.metrics.log({"step": step, "val_loss": val_loss})
        self._val_line(step, val_loss)

    def _val_line(self, step: int, val_loss: float) -> None:
        if step < self.console.total:  # the last one is in the trainer's closing line
            self.log(f"step {step}: val_loss {val_loss:.4f}")

    def close(self) -> None:
        """Close the bar; then the summary line (wall time, mean tokens/s, MFU) when steps were run."""
        self.console.close()
        if self.console.step_no > self.console.initial:
            self.log(self.console.summary())
