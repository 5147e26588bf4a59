"""What `moetrain train` prints (issue 20): in a log file (no TTY) one plain line per logging step and every
evaluation, no carriage returns; a closing summary with wall time, mean tokens/s and MFU; ``mfu`` and
``data_wait_s`` in metrics.jsonl."""

from __future__ import annotations

import io
import re

import pytest

from _crash_util import metrics, run_cli
from conftest import sample_text
from moetrain.train.console import Console, MfuModel, format_duration, use_bar

pytestmark = pytest.mark.usefixtures("one_thread")

LINE = re.compile(r"step (\d+)/12 \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| \d+ tokens/s \| ETA [\dhms.]+")


def test_a_log_file_gets_one_plain_line_per_logging_step_and_every_evaluation(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(sample_text(50_000))
    run, log = tmp_path / "run", tmp_path / "log.txt"
    # no --no-progress: the default, in a process whose stdout and stderr are a file (`> log.txt 2>&1`)
    argv = ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--steps", "12",
            f"data.cache_dir={tmp_path / 'cache'}", "train.log_every=3", "train.eval_every=4", "train.eval_batches=1"]
    assert run_cli(argv, log) == 0, log.read_text()
    text = log.read_text()
    assert "\r" not in text  # no progress bar in a file
    lines = text.splitlines()
    steps = [int(m.group(1)) for s in lines if (m := LINE.fullmatch(s))]
    assert steps == [3, 6, 9, 12]
    evals = [s for s in lines if re.fullmatch(r"step \d+: val_loss \d+\.\d{4}( \(before training: .*\))?", s)]
    assert [int(s.split()[1][:-1]) for s in evals] == [0, 4, 8, 12]  # 12: the closing line
    summary = [s for s in lines if s.startswith("trained 12 steps in ")]
    assert len(summary) == 1
    assert re.search(r": mean \d+ tokens/s, MFU \d+\.\d% of the calibrated GEMM peak", summary[0])
    assert re.fullmatch(r"threads: \d+ \(\d+ usable cores, load average [\d.]+; set train.threads=N to override\)",
                        next(s for s in lines if s.startswith("threads: ")))
    # run directory: printed once it exists, before the first step line
    assert lines.index(f"run directory: {run}") < lines.index(next(s for s in lines if LINE.fullmatch(s)))
    records = [r for r in metrics(run) if "train_loss" in r]
    assert [r["step"] for r in records] == [3, 6, 9, 12]
    for r in records:
        assert 0 < r["mfu"] < 1 and r["data_wait_s"] >= 0 and 0 < r["monitor_s"] < r["elapsed_s"]
    # mfu = analysis FLOPs per token x tokens/s / one calibrated peak: the same ratio in every record
    ratios = [r["mfu"] / r["tokens_per_s"] for r in records]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)


def _screen(raw: str) -> list[str]:
    """What a terminal shows after ``raw``: characters overwrite at the cursor, ``\r`` returns to column 0,
    ``\n`` goes down a line, ``ESC[nA`` up n lines, ``ESC[K`` erases to the end of the line."""
    lines: list[list[str]] = [[]]
    row = col = i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\x1b":
            m = re.match(r"\x1b\[(\d*)([AK])", raw[i:])
            assert m, repr(raw[i : i + 10])  # an escape sequence this renderer does not know
            if m.group(2) == "A":
                row = max(0, row - int(m.group(1) or 1))
            else:
                del lines[row][col:]
            i += len(m.group(0))
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            if row == len(lines):
                lines.append([])
        else:
            line = lines[row]
            line.extend(" " * (col - len(line) + 1))
            line[col] = ch
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in lines]


def test_on_a_terminal_evaluations_are_printed_above_the_bar(tmp_path):
    """stdout and stderr a pseudo-terminal (pty.openpty): the tqdm bar is drawn and updated in place, and every
    evaluation line is written above it (tqdm.write clears the bar, prints the line, redraws the bar): on the
    rendered screen each evaluation is a clean line of its own, before the one bar line left at the end, and no
    plain per-step lines are printed."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios
    from pathlib import Path

    from _crash_util import start_cli

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(sample_text(50_000))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 rows, 100 columns
    argv = ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(tmp_path / "run"), "--steps", "12",
            f"data.cache_dir={tmp_path / 'cache'}", "train.log_every=3", "train.eval_every=4", "train.eval_batches=1"]
    proc = start_cli(argv, Path(os.ttyname(slave)))  # the child opens the pty's slave as its stdout and stderr
    out = bytearray()
    try:
        while True:  # drain the master while the child runs (a full pty buffer would block it)
            if select.select([master], [], [], 0.2)[0]:
                try:
                    out += os.read(master, 1 << 16)
                except OSError:
                    break
            elif not proc.is_alive():
                break
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        os.close(master)
        os.close(slave)
    raw = out.decode()
    assert proc.exitcode == 0, raw
    frames = re.findall(r"\| *(\d+)/12 \[", raw)
    assert len(set(frames)) >= 4 and "\r" in raw  # the bar was drawn and updated in place
    assert not LINE.search(raw)  # no plain "step 3/12 | loss ..." lines on a terminal
    screen = _screen(raw)
    bars = [i for i, s in enumerate(screen) if re.search(r"\| *\d+/12 \[", s)]
    assert len(bars) == 1 and "12/12" in screen[bars[0]], screen  # one bar left on screen: nothing of it elsewhere
    evals = {int(s.split()[1][:-1]): i for i, s in enumerate(screen) if s.startswith("step ") and "val_loss" in s}
    assert sorted(evals) == [0, 4, 8, 12], screen
    for i in evals.values():  # each evaluation a clean line: no bar text around it
        assert re.fullmatch(r"step \d+: val_loss \d+\.\d{4}( \(before training: \d+\.\d{4}\))?", screen[i]), screen[i]
    assert evals[0] < evals[4] < evals[8] < bars[0] < evals[12]  # above the bar; the closing line after it


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_only_on_a_terminal():
    assert use_bar(True, _Tty()) and not use_bar(False, _Tty()) and not use_bar(True, io.StringIO())


def test_console_rates_and_summary(monkeypatch):
    """Tokens/s, MFU and ETA from a fake clock: 4 steps of 1000 tokens in 2 s, 1e6 FLOPs per token, 4e9 peak."""
    now = [100.0]
    monkeypatch.setattr("moetrain.train.console.time.perf_counter", lambda: now[0])
    lines: list[str] = []
    c = Console(total=10, initial=2, tokens_per_step=1000, mfu=MfuModel(1e6, 4e9), bar=False, log=lines.append)
    batch = c.timed(lambda: now.__setitem__(0, now[0] + 0.25))  # each batch takes 0.25 s
    for _ in range(4):
        batch()
        now[0] += 0.15
        with c.monitoring():  # 0.1 s of monitoring per step
            now[0] += 0.1
        c.step(loss=2.0, lr=1e-3)
    rates = c.logging_step(loss=2.0, lr=1e-3)
    assert rates == {"tokens_per_s": 2000.0, "data_wait_s": 1.0, "monitor_s": pytest.approx(0.4), "mfu": 0.5}
    assert lines == ["step 6/10 | loss 2.0000 | lr 1.00e-03 | 2000 tokens/s | ETA 2.0s"]
    assert c.summary() == ("trained 4 steps in 2.0s: mean 2000 tokens/s, MFU 50.0% of the calibrated GEMM peak "
                           "(waiting for data 50.0% of the time)")


def test_an_mfu_above_one_measures_the_peak_again(monkeypatch):
    """A peak calibrated while the machine was busier than during the steps (seen: "MFU 143.1%" at the end of a
    default run whose start calibrated under load 6): the peak is measured again and the best one kept; a second
    logging step does not measure again once the MFU is under 1."""
    now = [0.0]
    monkeypatch.setattr("moetrain.train.console.time.perf_counter", lambda: now[0])
    calls: list[int] = []
    model = MfuModel(1e6, 1e9, lambda: calls.append(1) or 4e9)  # the start's 1 GFLOP/s, then 4 GFLOP/s
    c = Console(total=4, initial=0, tokens_per_step=2000, mfu=model, bar=False, log=lambda _: None)
    for _ in range(2):
        now[0] += 1.0
        c.step(loss=1.0, lr=1e-3)
        assert c.logging_step(loss=1.0, lr=1e-3)["mfu"] == 0.5  # 1e6 x 2000 / 4e9, not 2.0
    assert calls == [1]
    assert "MFU 50.0% of the calibrated GEMM peak" in c.summary()


def test_tokens_per_s_counts_the_real_tokens_of_packed_batches(monkeypatch):
    """Token-budget / packed micro-batches: tokens/s (and so MFU) is their real tokens over the time, not
    tokens_per_step (batch_size x grad_accum x seq_len, which is not what a budget micro-batch holds)."""
    import torch

    from moetrain.data.batch import PackedBatch

    now = [0.0]
    monkeypatch.setattr("moetrain.train.console.time.perf_counter", lambda: now[0])
    c = Console(total=4, initial=0, tokens_per_step=8 * 1024, mfu=MfuModel(1e6, 1e9), bar=False, log=lambda _: None)

    def packed(real: int, positions: int) -> PackedBatch:
        mask = torch.arange(positions) < real
        return PackedBatch(torch.zeros(1, positions, dtype=torch.long), torch.zeros(1, positions, dtype=torch.long),
                           mask[None])

    for real in (300, 500):  # two steps, one micro-batch each, 1 s apart
        c.timed(lambda real=real: packed(real, 512))()
        now[0] += 1.0
        c.step(loss=1.0, lr=1e-3)
    rates = c.logging_step(loss=1.0, lr=1e-3)
    assert rates["tokens_per_s"] == 400.0 and rates["mfu"] == pytest.approx(0.4)
    assert c.summary().startswith("trained 2 steps in 2.0s: mean 400 tokens/s, MFU 40.0%")


@pytest.mark.parametrize("seconds, text", [(12.34, "12.3s"), (75, "1m15s"), (3725, "1h02m05s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
