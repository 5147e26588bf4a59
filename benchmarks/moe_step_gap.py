"""Where an MoE training step's extra time goes, against its dense twin of equal active parameters (issue 19).

Builds the MoE config (``cpu-small`` with the given overrides; by default the tinyshakespeare protocol of
docs/moe-vs-dense.md) and its dense twin (``model.moe_every=0``), optionally loads trained weights from two run
directories (``--runs DENSE_RUN MOE_RUN``: routing then has its trained balance, not the near-uniform one of a fresh
router), and times, interleaved round by round on the same real batch, medians over the rounds:

- ``step``: the trainer's optimizer step (``moetrain.train.step.train_step``: forward with the fused LM loss,
  the MoE losses, backward, clipping, AdamW, the expert-bias update);
- per FFN position, forward + backward on the inputs the step's own forward gave that layer (captured by a hook):
  the dense twin's ``SwiGLU``; the MoE layer whole, and its parts: ``router`` (logits, softmax, top-k, gating
  weights), ``experts`` (dispatch + expert FFNs + combine, the fused Function), ``losses and counts`` (the
  layer's ``MoEAux`` record: Switch aux loss, z-loss, counts; backward of the weighted terms only);
- ``AdamW``: the optimizer's update alone (the MoE has about 3x the parameters of its twin).

The rows add up to the layer's share; what the step costs beyond the sum of the parts is the rest of the model
(attention, norms, embedding, LM head), the same for both models. Prints a table; asserts nothing.

Usage: ``python benchmarks/moe_step_gap.py [--runs DENSE MOE] [--rounds 7] [--threads 1] [--clock cpu|wall]
[FIELD=VALUE ...]`` (overrides for both models; defaults: ``data.path=../shared/data/tinyshakespeare.txt
data.val_fraction=0.1 model.vocab_size=2048``; the preset's own aux 0.02).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moetrain.config import build_config
from moetrain.configlib import parse_overrides
from moetrain.data.dataset import BatchSampler, TokenWindows, prepare_data
from moetrain.model.transformer import MoETransformer
from moetrain.moe.layer import MoELayer
from moetrain.runtime.cpu import cpu_model
from moetrain.train.schedule import build_scheduler
from moetrain.train.step import train_step
from moetrain.train.trainer import build_optimizer

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
DEFAULTS = [f"data.path={SHAKESPEARE}", "data.val_fraction=0.1", "model.vocab_size=2048"]


def load_weights(model: torch.nn.Module, run_dir: str) -> None:
    from moetrain.train.checkpointer import load_latest_model

    load_latest_model(Path(run_dir) / "checkpoints", model, warn=print)


def capture_inputs(model: MoETransformer) -> dict[int, torch.Tensor]:
    """Hook every block's FFN (dense or MoE) to keep its latest input, detached."""
    seen: dict[int, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        block.ffn.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].detach()))
    return seen


def fwd_bwd(fn, *inputs: torch.Tensor) -> None:
    """Forward ``fn`` on fresh leaf copies of ``inputs`` and backward a ones-like gradient of its output."""
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))


Part = tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]


def moe_parts(layer: MoELayer, x: torch.Tensor) -> dict[str, Part]:
    """{part: (fn, input)} of one MoE layer on its captured input x [B, S, D]; the routing of ``experts`` is fixed."""
    tokens = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        routing = layer.router(tokens)
    losses = layer.config.losses

    def router(t):
        r = layer.router(t)
        return r.topk_weights.sum() + r.logits.sum() * 0  # the logits feed the z-loss / record

    def experts(t):
        return layer.dispatcher.forward(t, routing.topk_ids, routing.topk_weights.detach(), layer.experts)

    def record(t):
        r = layer.router(t)
        rec = layer._record(r, x.shape, None, None, None)
        terms = [(losses.aux_loss_coeff, rec.aux_loss), (losses.z_loss_coeff, rec.z_loss)]
        return sum(c * v for c, v in terms if c > 0) + rec.tokens_per_expert.sum() * 0

    def whole(t):
        y, rec = layer(t.reshape(x.shape))
        return y.sum() + losses.aux_loss_coeff * rec.aux_loss + losses.z_loss_coeff * rec.z_loss

    return {"MoE layer": (whole, tokens), "router": (router, tokens), "experts": (experts, tokens),
            "router + losses and counts": (record, tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="FIELD=VALUE for both models (after the defaults)")
    ap.add_argument("--runs", nargs=2, metavar=("DENSE_RUN", "MOE_RUN"), help="load trained weights from these")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this process's CPU time (robust on a shared machine); wall: elapsed time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    device = torch.device("cpu")
    base = parse_overrides(DEFAULTS + list(args.overrides))
    cfg_moe = build_config("cpu-small", overrides=base)
    cfg_dense = build_config("cpu-small", overrides=parse_overrides(
        DEFAULTS + list(args.overrides) + ["model.moe_every=0"]))
    data = prepare_data(cfg_moe.data, cfg_moe.model.vocab_size, log=lambda m: None)
    sampler = BatchSampler(TokenWindows(data.train_tokens, cfg_moe.data.seq_len), cfg_moe.train.batch_size, 0)
    models = {}
    for name, cfg, run in (("dense", cfg_dense, args.runs and args.runs[0]),
                           ("moe", cfg_moe, args.runs and args.runs[1])):
        torch.manual_seed(0)
        model = MoETransformer(cfg.model)
        if run:
            load_weights(model, run)
        model.train()
        opt = build_optimizer(model, cfg)
        for group in opt.param_groups:
            group["lr"] = 0.0  # time the update, keep the trained routing
        sched = build_scheduler(opt, cfg.train)
        models[name] = (cfg, model, opt, sched, capture_inputs(model))
    times: dict[str, list[float]] = {}

    def timed(key, fn, *a):
        t0 = clock()
        fn(*a)
        times.setdefault(key, []).append(clock() - t0)

    for r in range(args.rounds + 1):
        batch = sampler.next_batch()
        for name, (cfg, model, opt, sched, seen) in models.items():
            def step():
                train_step(model, lambda: batch, opt, sched, cfg.train, device)
            timed(f"{name}|step", step)
            for group in opt.param_groups:
                group["lr"] = 0.0
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            timed(f"{name}|AdamW", opt.step)
            opt.zero_grad(set_to_none=True)
            for i, block in enumerate(model.blocks):
                x = seen[i]
                if isinstance(block.ffn, MoELayer):
                    for part, (fn, t) in moe_parts(block.ffn, x).items():
                        timed(f"{name}|{part}|{i}", fwd_bwd, fn, t)
                else:
                    timed(f"{name}|dense FFN|{i}", fwd_bwd, lambda t: block.ffn(t), x)
            model.zero_grad(set_to_none=True)
        if r == 0:
            times.clear()  # warm-up round
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}

    def total(name, part):
        return sum(v for k, v in med.items() if k.startswith(f"{name}|{part}|") or k == f"{name}|{part}")

    print(f"# MoE step vs its dense twin: {cpu_model()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.clock} clock, medians of {args.rounds} interleaved rounds, ms per optimizer step "
          f"({cfg_moe.train.batch_size} x {cfg_moe.data.seq_len} tokens)")
    print(f"weights: {'trained, from ' + ' and '.join(args.runs) if args.runs else 'fresh (seed 0)'}")
    rows = [("optimizer step (train_step)", total("dense", "step"), total("moe", "step")),
            ("FFN fwd+bwd, all layers", total("dense", "dense FFN"), total("moe", "MoE layer")),
            ("  router fwd+bwd", 0.0, total("moe", "router")),
            ("  router + losses and counts fwd+bwd", 0.0, total("moe", "router + losses and counts")),
            ("  experts fwd+bwd (dispatch, FFNs, combine)", 0.0, total("moe", "experts")),
            ("AdamW update", total("dense", "AdamW"), total("moe", "AdamW"))]
    print("| part | dense twin ms | MoE ms | MoE - dense ms | share of the dense step |")
    print("|---|---|---|---|---|")
    dense_step = rows[0][1]
    for label, d, m in rows:
        print(f"| {label} | {d:.0f} | {m:.0f} | {m - d:+.0f} | {(m - d) / dense_step:+.1%} |")


if __name__ == "__main__":
    main()
