"""What a training run prints while it runs, and the rates it logs (:class:`~moetrain.train.progress.StepLog`
drives it; the output and the ``metrics.jsonl`` rates ``tokens_per_s``, ``mfu``, ``data_wait_s`` and ``monitor_s``:
docs/robustness.md). On a terminal (stderr a TTY, progress on) a tqdm bar, every other line printed above it with
``tqdm.write``; otherwise (a log file, ``--no-progress``) one plain line per logging step.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Callable, NamedTuple, TypeVar

from tqdm.auto import tqdm

if TYPE_CHECKING:  # imported where used: importing the console stays light
    import torch

    from moetrain.config import Config

T = TypeVar("T")


class MfuModel(NamedTuple):
    """The MFU's numerator per token and its denominator."""

    flops_per_token: float  # forward + backward model FLOPs per token (moetrain.analysis)
    peak_flops: float  # calibrated GEMM FLOP/s of this device in the compute dtype
    # Measures the peak again (uncached): when an MFU comes out above 1, the start's calibration ran on a busier
    # machine than the steps did (a shared machine whose load fell), and the peak is the best of the two.
    recalibrate: Callable[[], float] | None = None


def mfu_model(config: Config, device: torch.device) -> MfuModel:
    """:class:`MfuModel` of a full config on ``device`` (calibrates the GEMM peak once per process)."""
    import torch

    from moetrain.analysis.flops import model_flops_per_token
    from moetrain.analysis.shape import ModelShape
    from moetrain.runtime.cpu import bf16_compute, gemm_peak

    bf16 = config.train.dtype == "bf16" and bf16_compute(device)
    dtype = torch.bfloat16 if bf16 else torch.float32
    return MfuModel(model_flops_per_token(ModelShape.from_config(config.model), config.data.seq_len),
                    gemm_peak(dtype, device), lambda: gemm_peak(dtype, device, fresh=True))


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m05s``; under a minute ``12.3s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    h, m, s = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def use_bar(enabled: bool, stream: IO[str] | None = None) -> bool:
    """A bar only when asked for and stderr (where tqdm draws) is a terminal."""
    stream = sys.stderr if stream is None else stream
    return bool(enabled) and hasattr(stream, "isatty") and stream.isatty()


def say(line: str) -> None:
    """Print a line to stdout, above a progress bar if one is drawn (``tqdm.write``; plain ``print`` otherwise)."""
    tqdm.write(line, file=sys.stdout)


class Console:
    """Progress of one run (or one resumed part of it) from ``initial`` to ``total`` steps.

    Args:
        total: the run's ``train.steps``.
        initial: the step training starts from (0, or the resumed checkpoint's step).
        tokens_per_step: tokens of one optimizer step (batch_size * grad_accum * seq_len, all ranks).
        mfu: :class:`MfuModel`, or ``None`` (no MFU).
        bar: draw a tqdm bar (see :func:`use_bar`); else plain lines through ``log``.
        log: where lines go (the trainer's log; with a bar, pass :func:`say` so they appear above it).
    """

    def __init__(self, total: int, initial: int, tokens_per_step: int, mfu: MfuModel | None, bar: bool,
                 log: Callable[[str], None] = print):
        self.total, self.initial, self.step_no = total, initial, initial
        self.tokens_per_step, self.mfu_model, self.log = tokens_per_step, mfu, log
        self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True) if bar else None
        self._t0 = time.perf_counter()
        self._t_last, self._steps_since, self._wait_since = self._t0, 0, 0.0
        self.data_wait_s = 0.0  # whole run
        self._monitor_since = 0.0
        self._real_since, self._real_total = 0, 0  # real tokens of packed micro-batches read
        self._counts_real = False  # a packed micro-batch was read: tokens/s counts its real tokens

    def timed(self, next_batch: Callable[[], T]) -> Callable[[], T]:
        """``next_batch`` with its time added to ``data_wait_s`` (and, for packed documents, its real tokens
        counted for tokens/s)."""

        def wrapper() -> T:
            t0 = time.perf_counter()
            try:
                batch = next_batch()
            finally:
                dt = time.perf_counter() - t0
                self._wait_since += dt
                self.data_wait_s += dt
            real = getattr(batch, "real_tokens", None)  # a PackedBatch (data/batch.py); windows never pad
            if isinstance(real, int):
                self._counts_real = True
                self._real_since += real
                self._real_total += real
            return batch

        return wrapper

    @contextlib.contextmanager
    def monitoring(self) -> Iterator[None]:
        """Time the block as monitoring (``monitor_s``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._monitor_since += time.perf_counter() - t0

    def step(self, loss: float, lr: float) -> None:
        """One optimizer step done (call every step)."""
        self.step_no += 1
        self._steps_since += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", refresh=False)

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation at ``tokens_per_s`` (docs/robustness.md); above 1 the peak is measured again and
        the best peak kept (:attr:`MfuModel.recalibrate`), so a calibration taken under load does not report more
        than the machine can do."""
        m = self.mfu_model
        if m is None or not m.peak_flops:
            return None
        value = m.flops_per_token * tokens_per_s / m.peak_flops
        if value > 1 and m.recalibrate is not None:
            self.mfu_model = m = m._replace(peak_flops=max(m.peak_flops, m.recalibrate()))
            value = m.flops_per_token * tokens_per_s / m.peak_flops
        return value

    def logging_step(self, loss: float, lr: float) -> dict[str, float]:
        """At a logging step: the rates since the last one (``tokens_per_s``, ``mfu``, ``data_wait_s``,
        ``monitor_s``) for ``metrics.jsonl``; prints the plain line (no bar) or updates the bar's postfix."""
        now = time.perf_counter()
        tokens = self._real_since if self._counts_real else self.tokens_per_step * self._steps_since
        tps = tokens / max(now - self._t_last, 1e-9)
        rates = {"tokens_per_s": tps, "data_wait_s": self._wait_since, "monitor_s": self._monitor_since}
        mfu = self.mfu(tps)
        if mfu is not None:
            rates["mfu"] = mfu
        done = self.step_no - self.initial
        eta = (now - self._t0) / done * (self.total - self.step_no) if done else 0.0
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
        else:
            self.log(f"step {self.step_no}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | {tps:.0f} tokens/s | "
                     f"ETA {format_duration(eta)}")
        self._t_last, self._steps_since, self._wait_since, self._real_since = now, 0, 0.0, 0
        self._monitor_since = 0.0
        return rates

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def summary(self) -> str:
        """``trained N steps in WALL: mean T tokens/s, MFU x% ... (waiting for data y% of the time)``."""
        wall = time.perf_counter() - self._t0
        done = self.step_no - self.initial
        tokens = self._real_total if self._counts_real else self.tokens_per_step * done
        tps = tokens / wall if wall > 0 else 0.0
        text = f"trained {done} steps in {format_duration(wall)}: mean {tps:.0f} tokens/s"
        mfu = self.mfu(tps)
        if mfu is not None:
            text += f", MFU {100 * mfu:.1f}% of the calibrated GEMM peak"
        if wall > 0:
            text += f" (waiting for data {100 * self.data_wait_s / wall:.1f}% of the time)"
        return text
