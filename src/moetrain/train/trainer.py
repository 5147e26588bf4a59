"""The training loop: AdamW, warm-up + cosine, gradient accumulation, clipping, bf16 autocast, periodic
validation, metrics, checkpoints and exact resume.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` sequences of ``seq_len`` tokens. Every micro-batch
has the same number of tokens, so dividing each micro-batch's mean loss by ``grad_accum`` gives exactly the mean
over the whole step (LM loss, z-loss); the per-micro-batch Switch loss is likewise averaged over micro-batches.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from moetrain.config import Config
from moetrain.data.dataset import BatchSampler, PreparedData, TokenWindows, eval_batches, prepare_data
from moetrain.errors import MoetrainError
from moetrain.model.transformer import MoETransformer, count_parameters
from moetrain.train.checkpoint import (
    latest_valid_checkpoint,
    load_model_weights,
    load_train_state,
    save_checkpoint,
)
from moetrain.train.metrics import MetricsLogger
from moetrain.train.schedule import build_scheduler
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


def build_optimizer(model: torch.nn.Module, config: Config) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and expert tensors (dim >= 2) only, not on norms."""
    t = config.train
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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


class Trainer:
    """Owns one run directory. Use :meth:`run`; ``stop_at_step`` ends early with a checkpoint (for preemptible
    schedules and tests) so that ``resume=True`` continues exactly."""

    def __init__(self, config: Config, run_dir: Path, resume: bool = False, log: Callable[[str], None] = print,
                 progress: bool = True):
        self.config, self.run_dir, self.resume, self.log, self.progress = config, run_dir, resume, log, progress
        self.device = resolve_device(config.train.device)

    # -- setup -----------------------------------------------------------------------------------------------
    def _prepare(self) -> PreparedData:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tok_path = self.run_dir / TOKENIZER_FILE
        data = prepare_data(cfg.data, cfg.model.vocab_size, tokenizer_path=tok_path if tok_path.exists() else None,
                            log=self.log)
        if not tok_path.exists():
            tmp = tok_path.with_suffix(".tmp")
            data.tokenizer.save(str(tmp))
            tmp.replace(tok_path)
        (self.run_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2))
        return data

    def run(self, stop_at_step: int | None = None) -> TrainResult:
        cfg, t = self.config, self.config.train
        torch.use_deterministic_algorithms(t.deterministic, warn_only=True)
        seed_everything(t.seed)
        data = self._prepare()
        train_windows = TokenWindows(data.train_tokens, cfg.data.seq_len)
        val_windows = TokenWindows(data.val_tokens, cfg.data.seq_len)
        val_set = eval_batches(val_windows, t.batch_size, t.eval_batches)
        sampler = BatchSampler(train_windows, t.batch_size, t.seed)

        model = MoETransformer(cfg.model).to(self.device)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, t)
        total, active = count_parameters(model)
        self.log(
            f"model: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active per token; "
            f"{len(train_windows)} training windows of {cfg.data.seq_len} tokens; device {self.device}"
        )

        step, initial_val = 0, None
        ckpt_root = self.run_dir / "checkpoints"
        if self.resume:
            path = latest_valid_checkpoint(ckpt_root, warn=self.log)
            if path is None:
                raise MoetrainError(f"--resume: no usable checkpoint in {ckpt_root}")
            load_model_weights(model, path)
            state = load_train_state(path)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            sampler.load_state_dict(state["sampler"])
            set_rng_state(state["rng"])
            step, initial_val = state["step"], state.get("initial_val_loss")
            self.log(f"resumed from {path} at step {step}")

        metrics = MetricsLogger(self.run_dir)
        if initial_val is None:
            initial_val = evaluate(model, val_set, self.device, t.dtype)
            metrics.log({"step": 0, "val_loss": initial_val})
            self.log(f"step 0: val_loss {initial_val:.4f}")

        def checkpoint() -> None:
            state = {
                "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "sampler": sampler.state_dict(), "rng": rng_state(), "initial_val_loss": initial_val,
                "config": cfg.to_dict(),
            }
            save_checkpoint(ckpt_root, step, model, state, keep=t.keep_checkpoints)

        end = t.steps if stop_at_step is None else min(t.steps, stop_at_step)
        tokens_per_step = t.batch_size * t.grad_accum * cfg.data.seq_len
        losses: list[float] = []
        val_loss = None
        bar = tqdm(total=t.steps, initial=step, disable=not self.progress, unit="step", dynamic_ncols=True)
        model.train()
        t_last, steps_since = time.perf_counter(), 0
        while step < end:
            result = train_step(model, sampler.next_batch, optimizer, scheduler, t, self.device)
            lr = result.lr
            step += 1
            steps_since += 1
            loss_value = float(result.lm_loss)  # one host sync per step (the progress bar shows it)
            losses.append(loss_value)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", refresh=False)

            if step % t.log_every == 0 or step == end:
                now = time.perf_counter()
                tps = tokens_per_step * steps_since / (now - t_last)
                t_last, steps_since = now, 0
                record = {"step": step, "train_loss": loss_value, "lr": lr, "tokens_per_s": tps,
                          "aux_loss": float(result.aux_loss), "z_loss": float(result.z_loss),
                          "grad_norm": float(result.grad_norm)}
                if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                    val_loss = evaluate(model, val_set, self.device, t.dtype)
                    record["val_loss"] = val_loss
                bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
                metrics.log(record)
            elif (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                val_loss = evaluate(model, val_set, self.device, t.dtype)
                metrics.log({"step": step, "val_loss": val_loss})
            if (t.ckpt_every and step % t.ckpt_every == 0) or step == end:
                checkpoint()
        bar.close()
        metrics.close()
        if val_loss is not None:
            self.log(f"step {step}: val_loss {val_loss:.4f} (before training: {initial_val:.4f})")
        return TrainResult(self.run_dir, step, initial_val, val_loss, losses)
