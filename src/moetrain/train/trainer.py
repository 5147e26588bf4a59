"""The training loop: AdamW, warm-up + cosine, gradient accumulation, clipping, bf16 autocast, periodic
validation, metrics, checkpoints and exact resume.

:meth:`Trainer.run` is the loop only: step, log, evaluate, checkpoint, stop. What a resume restores is a
:class:`~moetrain.train.state.TrainState`, saved and loaded by a :class:`~moetrain.train.checkpointer.Checkpointer`;
what is reported lives in :mod:`moetrain.train.progress`; one optimizer step: :mod:`moetrain.train.step`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Iterable
from typing import Any, Callable, cast

import torch

from moetrain.config import Config
from moetrain.data.batch import Batch, model_inputs, real_tokens
from moetrain.data.dataset import PreparedData, prepare_data
from moetrain.data.loader import DataPipeline, build_pipeline, check_packing
from moetrain.errors import CheckpointError, ConfigError, MoetrainError
from moetrain.model.transformer import MoETransformer, count_parameters
from moetrain.parallel.launch import NullMetrics, ParallelHooks
from moetrain.parallel.layout import single_process
from moetrain.train.checkpoint import (CheckpointStore, CorruptCheckpoint, LoadedCheckpoint, load_model_weights,
                                       write_file_atomic)
from moetrain.train.checkpointer import Checkpointer
from moetrain.train import memory_stats
from moetrain.train.metrics import MetricsLogger
from moetrain.train.monitor import RoutingMonitor
from moetrain.train.param_groups import param_groups
from moetrain.train.preemption import GracefulStop
from moetrain.train.run_lock import RunLock
from moetrain.runtime.cpu import bf16_policy_line
from moetrain.runtime.threads import choose_threads
from moetrain.train.console import mfu_model
from moetrain.train.progress import StepLog, batches_fingerprint, logged_val_fingerprint
from moetrain.train.restart import last_logged_step, resume_record, torchrun_restart
from moetrain.train.resume_config import require_steps_reach
from moetrain.train.schedule import build_scheduler, retarget_schedule
from moetrain.train.state import TrainState, seed_everything
from moetrain.train.step import StepResult, autocast_context

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU.

    Raises:
        MoetrainError: ``cuda`` requested on a machine without CUDA.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise MoetrainError("train.device: 'cuda' requested but CUDA is not available on this machine")
    return torch.device(name)


def resume_hint(run_dir: Path, distributed: bool = False) -> str:
    """The command that continues a stopped run (what the stop messages suggest); the path quoted for a shell."""
    out = shlex.quote(str(run_dir))
    if distributed:
        return f"the same torchrun command with --resume (torchrun ... -m moetrain train --out {out} --resume)"
    return f"moetrain train --out {out} --resume"


def build_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.AdamW:
    """AdamW over :func:`~moetrain.train.param_groups.param_groups` (decay on matrices only, the routers' and
    experts' own learning-rate scales and decay), each group at ``train.lr * scale`` and carrying its ``lr_scale``
    (which the schedule multiplies: train/schedule.py).

    PyTorch's fused implementation (one kernel over all tensors; transformers' Trainer default ``adamw_torch_fused``)
    when every parameter is a floating-point CPU or CUDA tensor, plain or an FSDP2 ``DTensor`` shard (DTensor runs
    ``_fused_adamw_`` on the local shards; the per-tensor loop would dispatch each of its ~10 ops per parameter
    through DTensor); otherwise the default."""
    t = config.train
    groups = param_groups(model.named_parameters(), config)
    params = [p for g in groups for p in g.params]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params) or None
    return torch.optim.AdamW([{"params": g.params, "weight_decay": g.weight_decay, "lr": t.lr * g.lr_scale,
                               "lr_scale": g.lr_scale} for g in groups],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused)


@torch.no_grad()
def evaluate(model: MoETransformer, batches: Iterable[Batch], device: torch.device, dtype: str) -> float:
    """Mean LM loss (nats/token) over ``batches`` of (inputs, targets) [B, S] or PackedBatch (weighted by real
    tokens); the model is left in train mode."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        inputs, targets, kwargs = model_inputs(batch)
        kwargs = {k: None if v is None else v.to(device) for k, v in kwargs.items()}
        with autocast_context(device, dtype):
            out = model(inputs.to(device), targets.to(device), **kwargs)
        n = real_tokens(batch)
        total += float(out.lm_loss) * n
        count += n
    model.train()
    return total / max(count, 1)


__all__ = ["CONFIG_FILE", "TOKENIZER_FILE", "TrainResult", "Trainer", "build_optimizer", "evaluate",
           "resolve_device", "resume_hint"]


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    initial_val_loss: float | None
    final_val_loss: float | None
    losses: list[float]
    preempted: str | None = None  # the signal that stopped the run early ("SIGTERM"), if any
    nonfinite_skips: int = 0  # steps skipped for a non-finite loss or gradient over the whole run
    out_of_time: bool = False  # stopped early by train.time_budget_s (after a final evaluation and checkpoint)


@dataclass
class _Session:
    """One call of :meth:`Trainer.run`: the state being trained and what the loop reads and reports through.

    Attributes:
        state: model, optimizer, schedule, data position, step, counters (what a checkpoint holds).
        checkpointer: where checkpoints go.
        tokenizer: the run's ``tokenizer.json`` bytes (copied into each checkpoint).
        val_set: the fixed validation micro-batches.
        next_batch: this rank's rows of the next global micro-batch.
        report: progress bar, metrics records, log lines.
        end: the step this call stops after.
        losses: the LM loss of every step of this call.
        val_loss / val_step: the latest evaluation.
        saved_at: location of the checkpoint of the current step, once written.
        out_of_time: ``train.time_budget_s`` ran out; ``end`` is then the current step (the last).
    """

    state: TrainState
    checkpointer: Checkpointer
    tokenizer: bytes
    val_set: list[Batch]
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    report: StepLog
    end: int = 0
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    val_step: int | None = None
    saved_at: str | None = None
    out_of_time: bool = False


class Trainer:
    """Owns one run directory. Use :meth:`run`; ``stop_at_step`` ends early with a checkpoint (for preemptible
    schedules and tests) so that ``resume=True`` continues exactly."""

    def __init__(self, config: Config, run_dir: Path, resume: bool = False, log: Callable[[str], None] = print,
                 progress: bool = True, init_weights: dict[str, torch.Tensor] | None = None,
                 init_tokenizer: Path | None = None, hooks: ParallelHooks | None = None,
                 on_ready: Callable[[], None] | None = None):
        """``init_weights`` (our tensor names, e.g. ``model_tensors`` of an imported model) and ``init_tokenizer``
        (a ``tokenizer.json``) start a new run from given weights and tokenizer instead of a random initialisation
        and a newly trained tokenizer (fine-tuning, ``moetrain train --init-from``) while the run has no
        checkpoint; resuming from a checkpoint ignores them (it holds both). ``hooks`` make this one rank of an
        expert/data-parallel job (``moetrain.parallel.launch.start``, under ``torchrun``); default: one process.
        ``on_ready`` is called once every check has passed and the run directory is written (before training)."""
        self.on_ready = on_ready
        self.config, self.run_dir, self.resume, self.log, self.progress = config, run_dir, resume, log, progress
        self.init_weights, self.init_tokenizer = init_weights, init_tokenizer
        self.device = resolve_device(config.train.device)
        self.hooks = hooks if hooks is not None else ParallelHooks(single_process(self.device))
        self._memory_baseline = 0  # bytes in use before the model was built (train/memory_stats.py)

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self, stop_at_step: int | None = None) -> TrainResult:
        """Train to ``train.steps`` (or ``stop_at_step``, or the step that runs out ``train.time_budget_s``),
        evaluating, logging and checkpointing on the way.

        Raises:
            CheckpointError: ``--resume`` with no checkpoint that verifies, or a checkpoint that does not fit.
            ConfigError: bad input (the message names the field).
            MoetrainError: ``train.max_nonfinite_skips`` consecutive non-finite steps (after a checkpoint); a local
                ``train.checkpoint_url`` in use by another run.
            TrainingAlarm: a fatal routing alarm (after a checkpoint).
        """
        with self._lock_checkpoint_location():
            return self._run(stop_at_step)

    def _lock_checkpoint_location(self) -> contextlib.AbstractContextManager[Any]:
        """Rank 0 holds a lock on a local ``train.checkpoint_url`` as on the run directory (``run_lock.py``): two
        runs given the same location would otherwise both find it empty and then interleave their checkpoints.
        Object stores have no such lock."""
        url = self.config.train.checkpoint_url
        if url is None or not self.hooks.is_main:
            return contextlib.nullcontext()
        store = CheckpointStore(url)
        if not store.local or Path(store.root).resolve() == self.run_dir.resolve():  # that lock is held already
            return contextlib.nullcontext()
        return RunLock(store.root, name="train.checkpoint_url: the location", choose="train.checkpoint_url")

    def _run(self, stop_at_step: int | None) -> TrainResult:
        s = self._start(stop_at_step)
        preempted, finished = None, False
        with GracefulStop() as stop:
            try:
                while s.state.step < s.end:
                    result = self._step(s)
                    self._stop_if_out_of_time(s)
                    self._report(s, result)
                    self._checkpoint_if_due(s)
                    self._stop_if_diverged(s)
                    preempted = self._preempted(s, stop.received)
                    if preempted:
                        break
                finished = True
            finally:
                s.report.close(summary=finished)  # no "trained N steps ..." above an error
                s.state.monitor.close()
                s.report.metrics.close()
                s.state.sampler.close()  # stops DataLoader workers (data/loader.py)
        if s.val_loss is not None:
            self.log(f"step {s.val_step}: val_loss {s.val_loss:.4f} (before training: {s.state.initial_val_loss:.4f})")
        return TrainResult(self.run_dir, s.state.step, s.state.initial_val_loss, s.val_loss, s.losses, preempted,
                           s.state.nonfinite_total, s.out_of_time)

    def _step(self, s: _Session) -> StepResult:
        """One optimizer step, counted (and reported) as skipped when its loss or gradient was not finite."""
        st, t = s.state, self.config.train
        assert st.optimizer is not None  # _build_state made it
        result = self.hooks.train_step(st.model, s.next_batch, st.optimizer, st.scheduler, t, self.device)
        st.step += 1
        with s.report.console.monitoring():  # monitor_s
            st.monitor.end_step(st.step, result.lm_loss)  # device-side only
        loss = float(result.lm_loss)  # one host sync per step (the progress bar shows it)
        s.losses.append(loss)
        s.saved_at = None
        s.report.step(loss, result.lr)
        if result.skipped:
            st.nonfinite_total += 1
            st.nonfinite_in_a_row += 1
            s.report.skipped(st.step, result, loss, st.nonfinite_total, st.nonfinite_in_a_row, t.max_nonfinite_skips)
        else:
            st.nonfinite_in_a_row = 0
        return result

    def _report(self, s: _Session, result: StepResult) -> None:
        """At a logging step: the metrics record (with the evaluation when one is due), then the routing alarms;
        otherwise just the evaluation when due."""
        t, step = self.config.train, s.state.step
        eval_due = bool(t.eval_every and step % t.eval_every == 0) or step == t.steps or s.out_of_time
        if not (step % t.log_every == 0 or step == s.end):
            if eval_due:
                s.report.val(step, self._evaluate(s))
            return
        record = s.report.train_record(step, result, s.losses[-1])
        if eval_due:
            record["val_loss"] = self._evaluate(s)
        with s.report.console.monitoring():  # counted in the next record's monitor_s
            record.update(s.state.monitor.flush(step, s.report.metrics.writer))
        record.update(self.hooks.step_metrics())  # per-rank tokens and bytes exchanged
        record.update(memory_stats.memory_record(s.state.model, s.state.optimizer, self.device,
                                                 self._memory_baseline))  # per-rank peak memory (a collective)
        padding = s.state.sampler.take_padding_fraction()  # packed documents only
        if padding is not None:
            record["padding_fraction"] = padding
        with s.report.console.monitoring():
            s.report.write(record)
        # monitor.fatal alarms: checkpoint, then one-line error
        self.hooks.raise_if_fatal(s.state.monitor, functools.partial(self._save, s))

    def _stop_if_out_of_time(self, s: _Session) -> None:
        """Make the current step the last (evaluated, logged and checkpointed as at ``train.steps``) when its end
        passed ``train.time_budget_s`` seconds of the loop; every rank stops after the same step (one all-reduce
        per step when distributed, only with a budget)."""
        budget = self.config.train.time_budget_s
        if not budget or s.state.step >= s.end:
            return
        if self.hooks.agree_stop("train.time_budget_s" if s.report.elapsed_s >= budget else None):
            s.end, s.out_of_time = s.state.step, True
            s.report.last_step = s.state.step

    def _evaluate(self, s: _Session) -> float:
        t = self.config.train
        s.val_loss, s.val_step = self.hooks.evaluate(s.state.model, s.val_set, self.device, t.dtype), s.state.step
        return s.val_loss

    def _checkpoint_if_due(self, s: _Session) -> None:
        t, step = self.config.train, s.state.step
        if (t.ckpt_every and step % t.ckpt_every == 0) or step == s.end:
            self._save(s)

    def _save(self, s: _Session) -> str:
        """Checkpoint the current step once (a collective when distributed); returns its location."""
        if s.saved_at is None:
            run_files = {TOKENIZER_FILE: s.tokenizer, CONFIG_FILE: self._config_bytes()}
            s.saved_at = s.checkpointer.save(s.state, run_files)
        return s.saved_at

    def _stop_if_diverged(self, s: _Session) -> None:
        """Raise after ``train.max_nonfinite_skips`` consecutive skipped steps, with a checkpoint of the last good
        state: skipped steps changed no weights (the data position and RNG move on, so a resume does not replay
        the same batches)."""
        st, limit = s.state, self.config.train.max_nonfinite_skips
        if st.nonfinite_in_a_row < limit:
            return
        where = self._save(s)
        first = st.step - st.nonfinite_in_a_row + 1
        raise MoetrainError(
            f"train.max_nonfinite_skips: {st.nonfinite_in_a_row} consecutive steps ({first}-{st.step}) had a "
            f"non-finite loss or gradient, so training stopped; the last good state is in {where}; "
            "lower train.lr or check the data, then continue with --resume")

    def _preempted(self, s: _Session, received: str | None) -> str | None:
        """The stop signal (any rank's: every rank stops after the same step), after a checkpoint; else ``None``."""
        signal = self.hooks.agree_stop(received)
        if signal:
            where = self._save(s)
            self.log(f"{signal}: stopped after step {s.state.step} with checkpoint {where}; continue with: "
                     f"{resume_hint(self.run_dir, self.hooks.mesh.distributed)}")
        return signal

    # -- setup -------------------------------------------------------------------------------------------------
    def _start(self, stop_at_step: int | None) -> _Session:
        """Everything before the first step: checkpoint, data, model and optimizer, resume, run files, metrics,
        routing monitor, and the evaluation before training."""
        cfg, t = self.config, self.config.train
        threads = choose_threads(t.threads)  # process-wide; fewer than the cores on a loaded machine
        torch.use_deterministic_algorithms(t.deterministic, warn_only=True)
        seed_everything(t.seed)
        checkpointer = Checkpointer(t.checkpoint_url or self.run_dir / "checkpoints", keep=t.keep_checkpoints,
                                    milestone_every=t.milestone_every, optimizer_state=t.optimizer_state)
        ckpt, corrupt = self._find_checkpoint(checkpointer)
        data, tokenizer = self.hooks.prepare_data(lambda: self._prepare(ckpt), cfg.data, cfg.model.vocab_size)
        pipeline = self._pipeline(data)
        val_set = pipeline.val
        self._memory_baseline = memory_stats.reset_peak(self.device)  # before the model: what training adds
        state = self._build_state(data, ckpt, pipeline)
        checkpointer.layout = self.hooks.layout  # the expert shards exist now
        ckpt, saved = self._restore(checkpointer, ckpt, state, corrupt)
        # Everything that can reject the input has run: from here on the run directory is written (by rank 0).
        if self.hooks.is_main:
            self._write_run_files(tokenizer)
            for name in corrupt:  # never loaded again, kept for inspection
                self.log(f"moved the corrupt checkpoint {checkpointer.store.location(name)} aside to "
                         f"{checkpointer.store.quarantine(name)}")
        if self.on_ready is not None:
            self.on_ready()
        for line in (threads.line(), bf16_policy_line(t.dtype, self.device)):
            if line:
                self.log(line)
        metrics = self._open_metrics(state.step if ckpt is not None else -1) if self.hooks.is_main else NullMetrics()
        if ckpt is not None:
            self.log(f"resumed from {ckpt.location} at step {state.step}")
            before = logged_val_fingerprint(self.run_dir) if self.hooks.is_main else None
            if before is not None and before != batches_fingerprint(val_set):
                self.log("warning: the validation batches differ from those this run evaluated before the resume (its "
                         "corpus or data settings changed since it started): val_loss from here on does not compare "
                         "with the earlier values, and training reads the new corpus")
        elif self.resume:
            self.log(f"warning: no checkpoint in {checkpointer.store.url} yet: starting from step 0")
        monitor_cfg = cfg.monitor
        if monitor_cfg.collapse_from_step is None:  # no collapse alarm during the warm-up (monitor_config.py)
            monitor_cfg = replace(monitor_cfg, collapse_from_step=cfg.train.warmup_steps)
        state.monitor = RoutingMonitor(state.model, self.hooks.monitor_config(monitor_cfg), self.run_dir, self.log,
                                       start_step=state.step, stages=self.hooks.stage_routing())  # routing health
        if saved is not None:
            state.monitor.load_state_dict(saved.get("monitor"))
        next_batch = self.hooks.local_batch(state.sampler.next_batch)
        if state.initial_val_loss is None:
            state.initial_val_loss = self.hooks.evaluate(state.model, val_set, self.device, t.dtype)
            metrics.log({"step": 0, "val_loss": state.initial_val_loss, "val_sha256": batches_fingerprint(val_set)})
            self.log(f"step 0: val_loss {state.initial_val_loss:.4f}")
        report = StepLog(metrics, self.log, t.steps, state.step, t.batch_size * t.grad_accum * cfg.data.seq_len,
                         self.progress, mfu=mfu_model(cfg, self.device))
        if state.step == 0:  # first_batch_sha256 in the first logging record: which tokens the run started on
            next_batch = report.fingerprinted(next_batch)
        s = _Session(state, checkpointer, tokenizer, val_set, report.console.timed(next_batch),  # data_wait_s
                     report, end=t.steps if stop_at_step is None else min(t.steps, stop_at_step))
        state.model.train()
        return s

    def _open_metrics(self, resume_step: int) -> MetricsLogger:
        """The metrics writer (rank 0); on a resume, the records after ``resume_step`` (-1: no checkpoint) are
        dropped and, when steps were lost or torchrun restarted the group, one record says so (train/restart.py)."""
        if not self.resume:
            return MetricsLogger(self.run_dir)
        last = last_logged_step(self.run_dir / "metrics.jsonl")
        metrics = MetricsLogger(self.run_dir, resume_step=resume_step)
        record = resume_record(max(resume_step, 0), last, torchrun_restart())
        if record is not None:
            metrics.log(record)
            self.log(f"resumed at step {record['resumed_from_step']}: {record['lost_steps']} logged step(s) after it "
                     f"were lost and are trained again" + (f" (torchrun restart {record['torchrun_restart']})"
                                                           if record["torchrun_restart"] else ""))
        return metrics

    def _find_checkpoint(self, checkpointer: Checkpointer, corrupt: list[str] | None = None,
                         before: str | None = None) -> tuple[LoadedCheckpoint | None, list[str]]:
        """The checkpoint to resume from (``None`` without ``--resume``; older than ``before`` if given) and the
        names of the corrupt ones (``corrupt``, extended in place with the newer ones that failed verification).

        Raises:
            CheckpointError: ``--resume`` and every checkpoint is corrupt; or a new run whose checkpoint location
                already holds another run's checkpoints.
        """
        store = checkpointer.store
        ckpt, skipped = checkpointer.latest(warn=self.log, before=before) if self.resume else (None, [])
        corrupt = [] if corrupt is None else corrupt
        corrupt.extend(skipped)
        if self.resume and ckpt is None and corrupt:
            raise CheckpointError(f"--resume: no checkpoint in {store.url} verifies ({len(corrupt)} failed; see the "
                                  "warnings above)")
        if not self.resume and store.names():  # a later --resume would mix in another run's (newer) checkpoints
            raise CheckpointError(f"train.checkpoint_url: {store.url} already holds checkpoints "
                                  f"({store.names()[-1]} ...) of another run; choose another location or pass --resume")
        return ckpt, corrupt

    def _pipeline(self, data: PreparedData) -> DataPipeline:
        """Training batches (windows or packed documents, data/loader.py) and validation batches.

        Raises:
            ConfigError: ``data.packing=documents`` under torchrun (the ranks' row split assumes equal windows).
        """
        cfg, t = self.config, self.config.train
        check_packing(cfg.data.packing, self.hooks.mesh.world_size)
        return build_pipeline(data, cfg.data.seq_len, cfg.data.packing, t.batch_size, t.tokens_per_batch,
                              t.eval_batches, t.seed, cfg.data.workers, cfg.data.prefetch,
                              pin_memory=self.device.type == "cuda")

    def _build_state(self, data: PreparedData, ckpt: LoadedCheckpoint | None, pipeline: DataPipeline) -> TrainState:
        """A fresh state at step 0: model (``--init-from`` weights on a new run), sharded for this rank,
        optimizer, schedule, data sampler."""
        cfg, t = self.config, self.config.train
        # FSDP2 / pipeline engine: on the meta device, this rank's shards materialised by prepare_model
        model = self.hooks.build_model(cfg.model, self.device, t.seed)
        if ckpt is None and self.init_weights is not None:
            load_model_weights(model, self.init_weights, "--init-from")
        total, active = count_parameters(cast(MoETransformer, model))  # build_model's MoETransformer
        # expert parallelism: keep this rank's experts, dispatchers; FSDP2 / pipeline: this rank's shards / stages
        model = self.hooks.prepare_model(model, self.log)
        optimizer = build_optimizer(model, cfg)
        self.log(
            f"model: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token; "
            f"{pipeline.describe}; device {self.device}"
        )
        if pipeline.val_note:
            self.log(pipeline.val_note)
        return TrainState(model, optimizer, build_scheduler(optimizer, t), pipeline.train, config=cfg.to_dict())

    def _restore(self, checkpointer: Checkpointer, ckpt: LoadedCheckpoint | None, state: TrainState,
                 corrupt: list[str]) -> tuple[LoadedCheckpoint | None, dict[str, Any] | None]:
        """Load ``ckpt`` into ``state`` and stretch the LR schedule to this run's ``train.steps``; returns the
        checkpoint loaded and its ``train_state.pt`` content (``None`` without a checkpoint). A sharded checkpoint
        whose shard file fails verification when a rank reads it (every rank learns it from DCP) is reported,
        added to ``corrupt`` and replaced by the next older one that verifies, as at start-up: every rank falls
        back together, and the next load overwrites all that the failed one wrote.

        Raises:
            ConfigError: ``train.steps`` below the checkpoint's step.
            CheckpointError: no older checkpoint verifies either.
        """
        if ckpt is None:
            return None, None
        while True:
            try:
                saved = checkpointer.load(ckpt, state, warn=self.log)
                break
            except CorruptCheckpoint as e:
                self.log(f"warning: skipping checkpoint {ckpt.location}: {e}")
                corrupt.append(ckpt.name)
                older, _ = self._find_checkpoint(checkpointer, corrupt, before=ckpt.name)
                assert older is not None  # _find_checkpoint raised if none verifies: corrupt is not empty
                ckpt = older
        t = self.config.train
        require_steps_reach(t.steps, state.step, ckpt.location)
        assert state.optimizer is not None  # _build_state made it
        retarget_schedule(state.optimizer, state.scheduler, t)
        return ckpt, saved

    def _prepare(self, ckpt: LoadedCheckpoint | None) -> tuple[PreparedData, bytes]:
        """Tokenized data and the tokenizer's bytes. Writes nothing into the run directory (bad input must leave
        it untouched). On resume the checkpoint's copy of the tokenizer is authoritative: a run-directory copy
        that differs from it (damaged) is ignored here and rewritten by :meth:`_write_run_files`."""
        cfg = self.config
        tok_path = self.run_dir / TOKENIZER_FILE
        saved = ckpt.files.get(TOKENIZER_FILE) if ckpt is not None else None
        if saved is not None and (not tok_path.is_file() or tok_path.read_bytes() != saved):
            self.log(f"warning: {tok_path} is missing or differs from the checkpoint's copy; using the checkpoint's")
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / TOKENIZER_FILE).write_bytes(saved)
                data = prepare_data(cfg.data, cfg.model.vocab_size, tokenizer_path=Path(tmp) / TOKENIZER_FILE,
                                    log=self.log)
        else:
            use_saved = self.resume and tok_path.is_file()
            given = tok_path if use_saved else self.init_tokenizer
            data = prepare_data(cfg.data, cfg.model.vocab_size, tokenizer_path=given, log=self.log)
        return data, data.tokenizer.to_str().encode()

    def _write_run_files(self, tokenizer: bytes) -> None:
        """config.json and tokenizer.json, each written atomically (never seen half-written)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tok_path = self.run_dir / TOKENIZER_FILE
        if not tok_path.is_file() or tok_path.read_bytes() != tokenizer:
            write_file_atomic(tok_path, tokenizer)
        write_file_atomic(self.run_dir / CONFIG_FILE, self._config_bytes())

    def _config_bytes(self) -> bytes:
        return json.dumps(self.config.to_dict(), indent=2).encode()
