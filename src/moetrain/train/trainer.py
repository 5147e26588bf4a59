"""The training loop: AdamW, warm-up + cosine, gradient accumulation, clipping, bf16 autocast, periodic
validation, metrics, checkpoints and exact resume.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` sequences of ``seq_len`` tokens. Every micro-batch
has the same number of tokens, so dividing each micro-batch's mean loss by ``grad_accum`` gives exactly the mean
over the whole step (LM loss, z-loss); the per-micro-batch Switch loss is likewise averaged over micro-batches.
"""

from __future__ import annotations

import json
import random
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from moetrain.config import Config
from moetrain.data.dataset import BatchSampler, PreparedData, TokenWindows, eval_batches, prepare_data
from moetrain.errors import CheckpointError, ConfigError, MoetrainError
from moetrain.model.transformer import MoETransformer, count_parameters
from moetrain.parallel.launch import ParallelHooks
from moetrain.train.checkpoint import (
    MODEL_FILE,
    STATE_FILE,
    CheckpointStore,
    LoadedCheckpoint,
    checkpoint_name,
    encode_model,
    encode_state,
    load_model_weights,
    write_file_atomic,
)
from moetrain.train.metrics import MetricsLogger
from moetrain.train.monitor import RoutingMonitor
from moetrain.train.preemption import GracefulStop
from moetrain.train.schedule import build_scheduler, retarget_schedule
from moetrain.train.step import autocast_context, train_step

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
    """AdamW with weight decay on matrices and expert tensors (dim >= 2) only, not on norms.

    PyTorch's fused implementation (one kernel over all tensors; transformers' Trainer default ``adamw_torch_fused``)
    when every parameter is a plain CPU or CUDA tensor: on this project's 2-core CPU it steps cpu-small's 15.5M
    parameters in ~13 ms instead of ~40 ms for the per-tensor loop. Otherwise (e.g. DTensor shards) the default."""
    t = config.train
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point
                for p in params) or None
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every global RNG's state, as tensors and plain Python data (loadable with ``torch.load(weights_only=True)``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@torch.no_grad()
def evaluate(model: MoETransformer, batches, device: torch.device, dtype: str) -> float:
    """Mean LM loss (nats/token) over ``batches`` of (inputs, targets) [B, S]; the model is left in train mode."""
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in batches:
        with autocast_context(device, dtype):
            out = model(inputs.to(device), targets.to(device))
        n = targets.numel()
        total += float(out.lm_loss) * n
        count += n
    model.train()
    return total / max(count, 1)


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    initial_val_loss: float | None
    final_val_loss: float | None
    losses: list[float]
    preempted: str | None = None  # the signal that stopped the run early ("SIGTERM"), if any
    nonfinite_skips: int = 0  # steps skipped for a non-finite loss or gradient over the whole run


class Trainer:
    """Owns one run directory. Use :meth:`run`; ``stop_at_step`` ends early with a checkpoint (for preemptible
    schedules and tests) so that ``resume=True`` continues exactly."""

    def __init__(self, config: Config, run_dir: Path, resume: bool = False, log: Callable[[str], None] = print,
                 progress: bool = True, init_weights: dict[str, torch.Tensor] | None = None,
                 init_tokenizer: Path | None = None, hooks: ParallelHooks | None = None):
        """``init_weights`` (our tensor names, e.g. ``model_tensors`` of an imported model) and ``init_tokenizer``
        (a ``tokenizer.json``) start a new run from given weights and tokenizer instead of a random initialisation
        and a newly trained tokenizer (fine-tuning, ``moetrain train --init-from``) while the run has no
        checkpoint; resuming from a checkpoint ignores them (it holds both). ``hooks`` make this one rank of an
        expert/data-parallel job (``moetrain.parallel.launch.start``, under ``torchrun``); default: one process."""
        self.config, self.run_dir, self.resume, self.log, self.progress = config, run_dir, resume, log, progress
        self.init_weights, self.init_tokenizer = init_weights, init_tokenizer
        self.device = resolve_device(config.train.device)
        self.hooks = hooks if hooks is not None else ParallelHooks.local(self.device)

    # -- setup -----------------------------------------------------------------------------------------------
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

    def run(self, stop_at_step: int | None = None) -> TrainResult:
        cfg, t = self.config, self.config.train
        if t.threads:  # process-wide; on a shared machine fewer intra-op threads than cores avoid oversubscription
            torch.set_num_threads(t.threads)
        torch.use_deterministic_algorithms(t.deterministic, warn_only=True)
        seed_everything(t.seed)
        store = CheckpointStore(t.checkpoint_url or self.run_dir / "checkpoints")
        ckpt, corrupt = store.latest_valid(warn=self.log) if self.resume else (None, [])
        if self.resume and ckpt is None and corrupt:
            raise CheckpointError(f"--resume: no checkpoint in {store.url} verifies ({len(corrupt)} failed; see the "
                                  "warnings above)")
        if not self.resume and store.names():  # a later --resume would mix in another run's (newer) checkpoints
            raise CheckpointError(f"train.checkpoint_url: {store.url} already holds checkpoints "
                                  f"({store.names()[-1]} ...) of another run; choose another location or pass --resume")
        data, tokenizer_bytes = self.hooks.prepare_data(lambda: self._prepare(ckpt), cfg.data, cfg.model.vocab_size)
        train_windows = TokenWindows(data.train_tokens, cfg.data.seq_len)
        val_windows = TokenWindows(data.val_tokens, cfg.data.seq_len)
        val_set = eval_batches(val_windows, t.batch_size, t.eval_batches)
        sampler = BatchSampler(train_windows, t.batch_size, t.seed)

        model = MoETransformer(cfg.model).to(self.device)
        if ckpt is None and self.init_weights is not None:
            load_model_weights(model, self.init_weights, "--init-from")
        total, active = count_parameters(model)
        self.hooks.prepare_model(model, self.log)  # expert parallelism: keep this rank's experts, dispatchers
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, t)
        self.log(
            f"model: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token; "
            f"{len(train_windows)} training windows of {cfg.data.seq_len} tokens; device {self.device}"
        )

        step, initial_val, state = 0, None, {}
        skips_total, skips_in_a_row = 0, 0
        if ckpt is not None:
            sharded = self.hooks.load_checkpoint(ckpt, model, optimizer)  # sharded checkpoint or sharded model
            if not sharded:
                load_model_weights(model, ckpt.model_tensors(), f"{ckpt.location}/{MODEL_FILE}")
            state = ckpt.train_state()
            try:
                if not sharded:
                    optimizer.load_state_dict(state["optimizer"])
                scheduler.load_state_dict(state["scheduler"])
                sampler.load_state_dict(state["sampler"])
                set_rng_state(state["rng"])
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                raise CheckpointError(f"{ckpt.location}/{STATE_FILE}: does not fit this run: "
                                      f"{e.__class__.__name__}: {str(e).splitlines()[0]}") from None
            step, initial_val = state["step"], state.get("initial_val_loss")
            if t.steps < step:
                raise ConfigError(f"train.steps: {t.steps} is below the step of the checkpoint to resume "
                                  f"({step}, {ckpt.location}); give at least {step}")
            retarget_schedule(optimizer, scheduler, t)
            skips_total, skips_in_a_row = state.get("nonfinite_skips", (0, 0))

        # Everything that can reject the input has run: from here on the run directory is written (by rank 0).
        if self.hooks.is_main:
            self._write_run_files(tokenizer_bytes)
            for name in corrupt:  # never loaded again, kept for inspection
                self.log(f"moved the corrupt checkpoint {store.location(name)} aside to {store.quarantine(name)}")
        metrics = self.hooks.metrics_logger(lambda: MetricsLogger(
            self.run_dir, resume_step=(step if ckpt is not None else -1) if self.resume else None))
        if ckpt is not None:
            self.log(f"resumed from {ckpt.location} at step {step}")
        elif self.resume:
            self.log(f"warning: no checkpoint in {store.url} yet: starting from step 0")
        monitor = RoutingMonitor(model, self.hooks.monitor_config(cfg.monitor), self.run_dir, self.log,
                                 start_step=step)  # routing health
        if ckpt is not None:
            monitor.load_state_dict(state.get("monitor"))
        if initial_val is None:
            initial_val = evaluate(model, val_set, self.device, t.dtype)
            metrics.log({"step": 0, "val_loss": initial_val})
            self.log(f"step 0: val_loss {initial_val:.4f}")

        def checkpoint() -> str:
            state = {
                "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "sampler": sampler.state_dict(), "rng": rng_state(), "initial_val_loss": initial_val,
                "config": cfg.to_dict(), "monitor": monitor.state_dict(),
                "nonfinite_skips": (skips_total, skips_in_a_row),
            }
            files = self.hooks.checkpoint_files(model, optimizer, state)  # sharded (a collective) or None
            if files is None:
                files = {MODEL_FILE: encode_model(model), STATE_FILE: encode_state(state)}
            if not self.hooks.is_main:  # rank 0 writes every rank's shards
                return store.location(checkpoint_name(step))
            files.update({TOKENIZER_FILE: tokenizer_bytes, CONFIG_FILE: self._config_bytes()})
            where = store.save(step, files)
            store.prune(t.keep_checkpoints, t.milestone_every)
            return where

        end = t.steps if stop_at_step is None else min(t.steps, stop_at_step)
        tokens_per_step = t.batch_size * t.grad_accum * cfg.data.seq_len
        losses: list[float] = []
        val_loss, val_step = None, None
        bar = tqdm(total=t.steps, initial=step, disable=not self.progress, unit="step", dynamic_ncols=True)
        model.train()
        next_batch = self.hooks.local_batch(sampler.next_batch)  # this rank's rows of each global batch
        t_last, steps_since = time.perf_counter(), 0
        preempted, where = None, None
        with GracefulStop() as stop:
            try:
                while step < end:
                    result = train_step(model, next_batch, optimizer, scheduler, t, self.device,
                                        **self.hooks.step_kwargs())
                    lr = result.lr
                    step += 1
                    steps_since += 1
                    monitor.end_step(step, result.lm_loss)  # device-side only
                    loss_value = float(result.lm_loss)  # one host sync per step (the progress bar shows it)
                    losses.append(loss_value)
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", refresh=False)
                    if result.skipped:
                        skips_total += 1
                        skips_in_a_row += 1
                        self.log(f"warning: step {step}: non-finite loss ({loss_value}) or gradient norm "
                                 f"({float(result.grad_norm)}): update skipped ({skips_in_a_row} in a row, "
                                 f"{skips_total} in total; train.max_nonfinite_skips={t.max_nonfinite_skips})")
                        metrics.log({"step": step, "skipped_nonfinite": True, "nonfinite_skips": skips_total})
                    else:
                        skips_in_a_row = 0

                    if step % t.log_every == 0 or step == end:
                        now = time.perf_counter()
                        tps = tokens_per_step * steps_since / (now - t_last)
                        t_last, steps_since = now, 0
                        record = {"step": step, "train_loss": loss_value, "lr": lr, "tokens_per_s": tps,
                                  "aux_loss": float(result.aux_loss), "z_loss": float(result.z_loss),
                                  "grad_norm": float(result.grad_norm)}
                        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                            val_loss, val_step = evaluate(model, val_set, self.device, t.dtype), step
                            record["val_loss"] = val_loss
                        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
                        record.update(monitor.flush(step, metrics.writer))
                        record.update(self.hooks.step_metrics())  # per-rank tokens and bytes exchanged
                        metrics.log(record)
                        # monitor.fatal alarms: checkpoint, then one-line error
                        self.hooks.raise_if_fatal(monitor, checkpoint)
                    elif (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                        val_loss, val_step = evaluate(model, val_set, self.device, t.dtype), step
                        metrics.log({"step": step, "val_loss": val_loss})
                    saved = (t.ckpt_every and step % t.ckpt_every == 0) or step == end
                    if saved:
                        where = checkpoint()
                    if skips_in_a_row >= t.max_nonfinite_skips:
                        # Skipped steps changed no weights: this checkpoint holds the last good state (the data
                        # position and RNG move on, so a resume does not replay the same batches).
                        where = where if saved else checkpoint()
                        first = step - skips_in_a_row + 1
                        raise MoetrainError(
                            f"train.max_nonfinite_skips: {skips_in_a_row} consecutive steps ({first}-{step}) had a "
                            f"non-finite loss or gradient, so training stopped; the last good state is in {where}; "
                            "lower train.lr or check the data, then continue with --resume")
                    signal = self.hooks.agree_stop(stop.received)  # every rank stops after the same step
                    if signal:
                        where = where if saved else checkpoint()
                        preempted = signal
                        self.log(f"{preempted}: stopped after step {step} with checkpoint {where}; continue with: "
                                 f"{resume_hint(self.run_dir, self.hooks.distributed)}")
                        break
            finally:
                bar.close()
                monitor.close()
                metrics.close()
        if val_loss is not None:
            self.log(f"step {val_step}: val_loss {val_loss:.4f} (before training: {initial_val:.4f})")
        return TrainResult(self.run_dir, step, initial_val, val_loss, losses, preempted, skips_total)
