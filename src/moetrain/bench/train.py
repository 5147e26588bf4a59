"""``moetrain bench train``: tokens/s and peak memory of full training steps, moetrain's model against
transformers' ``MixtralForCausalLM`` with the identical configuration, batch and weights.

Legend: B = batch (sequences), S = sequence length, L = layers, E = experts, K = top-k.

One training step = forward with the loss, backward, ``AdamW.step()``, ``zero_grad(set_to_none=True)``; the same
batch every step. Both models get PyTorch's fused AdamW (``fused=True``): moetrain's trainer uses it, and so does
transformers' ``Trainer`` by default (``optim="adamw_torch_fused"``). moetrain's model is called as its trainer
calls it (``return_logits=False``: LM head and loss fused, moetrain/model/fused_ce.py); transformers' with
``labels``. The transformers model is built from the same config with a copy of moetrain's initial weights by the
HF interop (:func:`moetrain.interop.hf.to_hf_model`) and computes its load-balancing aux loss
(``output_router_logits=True``), as moetrain's model computes its aux and z losses. Before timing, the
cross-entropy of both models on the batch is compared (``lm_loss_diff``): the same weights must give the same loss.

``--dtype bf16`` runs both models under ``torch.autocast(device, bfloat16)`` with fp32 master weights (how moetrain's
trainer runs bf16). Note that transformers' ``grouped_mm`` experts cast their input back to the fp32 weight dtype
under autocast (``grouped_mm`` has no autocast rule), so its experts then run in fp32; moetrain's run in bf16.

Timing and memory as in moetrain/bench/common.py: candidates interleaved round by round, medians; peak memory is
the most torch tensor bytes alive during one step above the level at its start (activations, gradients,
temporaries; the weights and AdamW states, allocated before and equal for both models, are reported separately).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from moetrain.bench import add_measurement_args, choose, write_report
from moetrain.errors import ConfigError

OURS_BACKENDS = ("fused", "grouped_mm", "loop", "padded")
HF_IMPLS = ("grouped_mm", "eager")


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="full training steps: moetrain's model vs transformers' MixtralForCausalLM")
    p.add_argument("--preset", default="cpu-small", help="model preset (default cpu-small; Mixtral-style)")
    p.add_argument("--batch", type=int, default=None, help="B sequences per step (default: the preset's)")
    p.add_argument("--seq", type=int, default=None, help="S tokens per sequence (default: the preset's)")
    p.add_argument("--experts", type=int, default=None, help="override model.moe.num_experts (E)")
    p.add_argument("--top-k", type=int, default=None, help="override model.moe.top_k (K)")
    p.add_argument("--expert-ffn", type=int, default=None,
                   help="override model.moe.experts.ffn_hidden (F); e.g. --experts 64 --top-k 8 --expert-ffn 32 "
                        "is cpu-small's fine-grained twin (same K * F active expert width)")
    p.add_argument("--backends", default="fused,grouped_mm",
                   help=f"moetrain expert backends to run, comma-separated from {','.join(OURS_BACKENDS)}")
    p.add_argument("--hf", default="grouped_mm,eager",
                   help="transformers experts_implementation(s) to run, comma-separated (grouped_mm, eager)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="fp32, or bf16 autocast with fp32 master weights (default fp32)")
    p.add_argument("--steps", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--lr", type=float, default=1e-4)
    add_measurement_args(p)
    p.set_defaults(func=run)


def build_models(args):
    """(moetrain ModelConfig, {name: model}) with identical initial weights, plus the batch (B, S)."""
    import torch

    from moetrain.configlib import from_dict, merge
    from moetrain.interop.families import MIXTRAL, family_for
    from moetrain.interop.hf import to_hf_model
    from moetrain.model.config import ModelConfig
    from moetrain.model.transformer import MoETransformer
    from moetrain.presets import SHAPE_ONLY, preset_dict

    if args.preset in SHAPE_ONLY:
        raise ConfigError(f"--preset {args.preset}: a shape-only preset is too large to train here")
    preset = preset_dict(args.preset)
    batch = args.batch or preset.get("train", {}).get("batch_size", 8)  # checked by moetrain/commands/bench.py
    seq = args.seq or preset.get("data", {}).get("seq_len", 256)
    moe = {k: v for k, v in (("num_experts", args.experts), ("top_k", args.top_k)) if v is not None}
    if args.expert_ffn is not None:
        moe["experts"] = {"ffn_hidden": args.expert_ffn}
    model_dict = merge(preset["model"], {"moe": moe})  # validated by ModelConfig
    model_dict["max_seq_len"] = max(model_dict.get("max_seq_len", seq), seq)
    models = {}
    ref_cfg = None
    torch.manual_seed(args.seed)
    for backend in choose(args.backends, OURS_BACKENDS, "backends"):
        execution = {**model_dict.get("execution", {}), "moe_backend": backend}
        cfg = from_dict(ModelConfig, {**model_dict, "execution": execution}, "model")
        model = MoETransformer(cfg)
        if ref_cfg is None:
            ref_cfg, ref = cfg, model
        else:
            model.load_state_dict(ref.state_dict())
        models[f"moetrain-{backend}"] = model
    if ref_cfg is None:
        raise ConfigError("--backends: give at least one moetrain backend")
    family = family_for(ref_cfg)
    if family is not MIXTRAL:
        raise ConfigError(f"--preset {args.preset}: bench train compares against MixtralForCausalLM; this preset maps "
                          f"to {family.model_type}")
    for impl in choose(args.hf, HF_IMPLS, "hf"):
        hf = to_hf_model(ref, runnable=True, attn_implementation="sdpa", experts_implementation=impl)
        hf.config.output_router_logits = True
        models[f"hf-{impl}"] = hf
    return ref_cfg, models, batch, seq


def run(args) -> int:
    import torch

    from moetrain.bench.common import interleaved_times, machine_info, peak_tensor_bytes, summary

    cfg, models, batch, seq = build_models(args)
    models = {name: model.to(args.device) for name, model in models.items()}
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)  # next token; HF shifts labels itself
    ids, targets = ids.to(args.device), targets.to(args.device)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def loss_of(name, model):
        if name.startswith("moetrain"):  # as the trainer calls it (moetrain/train/step.py)
            out = model(ids, targets, return_logits=False)
            return out.loss, out.lm_loss
        out = model(input_ids=ids, labels=ids)
        return out.loss, out.loss - model.config.router_aux_loss_coef * out.aux_loss

    lm_loss = {}
    with torch.no_grad(), autocast:
        for name, model in models.items():
            model.train()
            lm_loss[name] = float(loss_of(name, model)[1])
    opts = {n: torch.optim.AdamW(m.parameters(), lr=args.lr, fused=True) for n, m in models.items()}

    def step(name: str) -> None:
        with autocast:
            loss = loss_of(name, models[name])[0]
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    steps: dict[str, Callable[[], None]] = {n: functools.partial(step, n) for n in models}
    sync = torch.cuda.synchronize if args.device == "cuda" else None
    times = interleaved_times(steps, rounds=args.steps, warmup=args.warmup, sync=sync, clock=args.clock)
    tokens = batch * seq
    rows = {}
    for name, model in models.items():
        s = summary(times[name])
        static = sum(p.numel() * p.element_size() for p in model.parameters())
        static += sum(t.numel() * t.element_size() for st in opts[name].state.values() for t in st.values()
                      if torch.is_tensor(t))
        rows[name] = {**s, "times_s": times[name], "tokens_per_s": tokens / s["median_s"],
                      "tokens_per_s_best": tokens / s["min_s"],
                      "peak_bytes": None if args.no_memory else peak_tensor_bytes(steps[name], args.device),
                      "weights_and_adam_bytes": static, "lm_loss_at_init": lm_loss[name]}
    hf_names = [n for n in rows if n.startswith("hf-")]
    best_hf = min(hf_names, key=lambda n: rows[n]["median_s"]) if hf_names else None
    ref_loss = next(iter(lm_loss.values()))
    for name, r in rows.items():
        r["lm_loss_diff"] = abs(r["lm_loss_at_init"] - ref_loss)
        if best_hf:
            r["speedup_vs_best_hf"] = rows[best_hf]["median_s"] / r["median_s"]
            hb = rows[best_hf]["peak_bytes"]
            r["peak_vs_best_hf"] = r["peak_bytes"] / hb if hb and r["peak_bytes"] is not None else None
    report = {
        "machine": machine_info(), "batch": batch, "seq": seq, "tokens_per_step": tokens, "best_hf": best_hf,
        "model": {"preset": args.preset, "layers": cfg.n_layers, "hidden": cfg.hidden, "experts": cfg.moe.num_experts,
                  "top_k": cfg.moe.top_k, "expert_ffn": cfg.moe.experts.ffn_hidden, "vocab": cfg.vocab_size},
        "candidates": rows,
    }
    _print(args, report)
    write_report(args, report)
    return 0


def _print(args, report: dict) -> None:
    from moetrain.bench.common import cpu_line

    m, a = report["model"], vars(args)
    print(f"bench train: preset {m['preset']} (L={m['layers']}, D={m['hidden']}, E={m['experts']}, K={m['top_k']}, "
          f"F={m['expert_ffn']}, V={m['vocab']}), batch {report['batch']} x {report['seq']} = "
          f"{report['tokens_per_step']} tokens, {a['dtype']}, fused AdamW; {a['steps']} timed rounds interleaved; "
          f"{a['device']}, {report['machine']['threads']} threads, {a['clock']} clock; load average "
          f"{report['machine']['load_avg_1_5_15min']}; {cpu_line(report['machine'])}")
    print(f"  {'candidate':<22} {'tok/s':>8} {'step ms':>8} {'min-max ms':>17} {'vs best HF':>10} {'peak MB':>8} "
          f"{'peak/HF':>8} {'lm loss':>8}")
    for name, r in report["candidates"].items():
        peak = f"{r['peak_bytes'] / 2**20:8.1f}" if r["peak_bytes"] is not None else f"{'-':>8}"
        ratio = f"{r['peak_vs_best_hf']:8.2f}" if r.get("peak_vs_best_hf") else f"{'-':>8}"
        speed = f"{r['speedup_vs_best_hf']:9.2f}x" if r.get("speedup_vs_best_hf") else f"{'-':>10}"
        print(f"  {name:<22} {r['tokens_per_s']:8.0f} {r['median_s'] * 1e3:8.1f} "
              f"{r['min_s'] * 1e3:8.1f}-{r['max_s'] * 1e3:<8.1f} {speed} {peak} {ratio} {r['lm_loss_at_init']:8.4f}")
    print("  peak MB: most torch tensor bytes alive during one step above its start (activations, gradients, "
          "temporaries); weights + AdamW state: "
          + ", ".join(f"{n} {r['weights_and_adam_bytes'] / 2**20:.1f} MB" for n, r in report["candidates"].items()))
