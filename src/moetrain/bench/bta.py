"""``moetrain bench bta``: at a fixed global batch, (a) the whole batch at once, (b) gradient accumulation over G
micro-batches, (c) BTA with G tiles; tokens/s, saved-activation bytes and tokens per expert GEMM (what each mode
costs and how it is measured: docs/bta.md).

Legend: B = global batch (sequences), G = tiles / micro-batches, S = sequence, E = experts, K = top-k.

Each round runs one training step (forward, backward, AdamW step) of every mode, interleaved
(moetrain/bench/common.py). Saved bytes: ``torch.autograd.graph.saved_tensors_hooks`` (moetrain/analysis/saved.py),
what one step's forward keeps for backward, plus for BTA the inputs its tile checkpoints hold and one tile's
recomputed attention.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics

from moetrain.bench import add_json_arg
from moetrain.errors import ConfigError

MODES = ("a", "b", "c")
NAMES = {"a": "whole batch", "b": "grad accumulation", "c": "BTA"}


def add_parser(sub) -> None:
    p = sub.add_parser("bta", help="BTA vs whole batch vs gradient accumulation at a fixed global batch")
    p.add_argument("--experts", type=int, default=64, help="E (default 64)")
    p.add_argument("--top-k", type=int, default=2, help="K (default 2)")
    p.add_argument("--hidden", type=int, default=128, help="D (default 128)")
    p.add_argument("--expert-ffn", type=int, default=2048, help="F, each expert's FFN hidden (default 2048)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: = heads)")
    p.add_argument("--head-dim", type=int, default=None, help="per-head width (default: hidden / heads)")
    p.add_argument("--qk-norm", choices=["none", "head", "full"], default="none", help="model.qk_norm")
    p.add_argument("--layers", type=int, default=2, help="blocks, all MoE (default 2)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary (default 512)")
    p.add_argument("--seq", type=int, default=512, help="S (default 512)")
    p.add_argument("--batch", type=int, default=4, help="global batch B in sequences (default 4)")
    p.add_argument("--tiles", type=int, default=4, help="G: micro-batches in (b), tiles in (c) (default 4)")
    p.add_argument("--steps", type=int, default=6, help="timed rounds (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--backend", default="fused", help="model.execution.moe_backend (default fused)")
    p.add_argument("--recompute-experts", action=argparse.BooleanOptionalAction, default=True,
                   help="model.execution.recompute_experts in all modes: the experts keep no intermediates for "
                        "backward (default on)")
    p.add_argument("--attention", choices=["fused", "math"], default="math",
                   help="SDPA kernel: math (default: materialises the S x S scores, attention memory quadratic in S, "
                        "the BTA paper's setting) or fused (PyTorch's choice: flash on CPU)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: one core measures the same on an idle or a shared "
                        "machine; 0 keeps PyTorch's default)")
    p.add_argument("--seed", type=int, default=0)
    add_json_arg(p)
    p.set_defaults(func=run)


def _check(args) -> None:
    from moetrain.commands import check_at_least

    check_at_least(args, 1, "experts", "top_k", "hidden", "expert_ffn", "heads", "kv_heads", "layers", "vocab", "seq")
    if args.tiles < 2:
        raise ConfigError(f"--tiles: must be >= 2 (G = 1 is mode (a) itself), got {args.tiles}")
    if args.batch % args.tiles:
        raise ConfigError(f"--tiles: {args.tiles} does not divide --batch {args.batch}")


def run(args) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moetrain.analysis.activations import model_activations
    from moetrain.analysis.hardware import calibrate_cpu
    from moetrain.analysis.intensity import expert_intensity
    from moetrain.analysis.saved import saved_bytes_per_block
    from moetrain.analysis.shape import ModelShape
    from moetrain.bench import write_report
    from moetrain.bench.common import interleaved_times, machine_info
    from moetrain.configlib import from_dict
    from moetrain.model.config import ModelConfig
    from moetrain.model.transformer import MoETransformer

    _check(args)
    g = args.tiles
    model_dict = {
        "vocab_size": args.vocab, "hidden": args.hidden, "n_layers": args.layers, "n_heads": args.heads,
        "n_kv_heads": args.heads if args.kv_heads is None else args.kv_heads, "head_dim": args.head_dim, "qk_norm": args.qk_norm, "ffn_hidden": 4 * args.hidden, "max_seq_len": args.seq,
        "moe": {"num_experts": args.experts, "top_k": args.top_k, "experts": {"ffn_hidden": args.expert_ffn}},
        "execution": {"moe_backend": args.backend, "recompute_experts": args.recompute_experts},
    }
    base = from_dict(ModelConfig, model_dict, "model")
    tiled = from_dict(ModelConfig, {**model_dict, "execution": {**model_dict["execution"], "bta_tiles": g}}, "model")
    torch.manual_seed(args.seed)
    ref = MoETransformer(base)
    models = {"a": ref, "b": MoETransformer(base), "c": MoETransformer(tiled)}
    for m in models.values():
        m.load_state_dict(ref.state_dict())
        m.train()
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for k, m in models.items()}  # as the trainer
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    micro = {"a": 1, "b": g, "c": 1}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    kernel = sdpa_kernel([SDPBackend.MATH]) if args.attention == "math" else contextlib.nullcontext()

    def step(mode: str) -> None:
        model, n = models[mode], micro[mode]
        for i, t in zip(ids.chunk(n), tgt.chunk(n)):
            with autocast:
                loss = model(i, t, return_logits=False).loss  # as the trainer calls it
            (loss / n).backward()
        opts[mode].step()
        opts[mode].zero_grad(set_to_none=True)

    with kernel:
        times = interleaved_times({k: functools.partial(step, k) for k in MODES}, args.steps, args.warmup)
        with autocast:  # one micro-batch of each mode
            saved = {k: saved_bytes_per_block(models[k], ids[: args.batch // micro[k]], tgt[: args.batch // micro[k]],
                                              return_logits=False) for k in MODES}

    shape = ModelShape.from_config(base)
    flags = [base.is_moe_layer(i) for i in range(base.n_layers)]
    act_bytes = 2 if args.dtype == "bf16" else 4
    predicted = {k: model_activations(shape, flags, args.batch // micro[k], args.seq, g if k == "c" else 1,
                                      act_bytes=act_bytes, attention_kernel=args.attention, fused_loss=True).peak
                 for k in MODES}
    tokens = args.batch * args.seq
    cpu = calibrate_cpu()
    intensity = {k: expert_intensity(shape, tokens // micro[k] * args.top_k / args.experts, act_bytes, act_bytes)
                 .intensity for k in MODES}
    rows = {
        k: {
            "mode": NAMES[k],
            "step_s_median": statistics.median(times[k]),
            "step_s_best": min(times[k]),
            "tokens_per_s": tokens / statistics.median(times[k]),
            "tokens_per_s_best": tokens / min(times[k]),
            "saved_bytes": saved[k].peak,
            "saved_bytes_attention": sum(saved[k].attention) + saved[k].tile_recompute,
            "saved_bytes_ffn": saved[k].peak - sum(saved[k].attention) - saved[k].tile_recompute - saved[k].other,
            "saved_bytes_predicted": predicted[k],
            "tokens_per_expert_gemm": tokens // micro[k] * args.top_k / args.experts,
            "expert_gemm_flops_per_byte": intensity[k],
        }
        for k in MODES
    }
    ratios = {f"c_over_{base}_{key}": rows["c"][key] / rows[base][key]
              for base, key in (("b", "tokens_per_s"), ("b", "tokens_per_s_best"), ("b", "saved_bytes"),
                                ("a", "tokens_per_s"), ("a", "saved_bytes"))}
    machine = {**machine_info(), "calibrated_flops": cpu.peak_flops, "calibrated_bytes_per_s": cpu.mem_bw,
               "ridge_flops_per_byte": cpu.ridge}
    _print_table(args, rows, ratios, cpu.ridge, machine)
    write_report(args, {"machine": machine, "tokens_per_step": tokens, "modes": rows, "ratios": ratios})
    return 0


def _print_table(args, rows, ratios, ridge: float, machine: dict) -> None:
    from moetrain.bench.common import cpu_line

    g = args.tiles
    print(f"bench bta: E={args.experts} top-{args.top_k}, D={args.hidden}, F={args.expert_ffn}, H={args.heads}, "
          f"Hd={args.head_dim or args.hidden // args.heads}, "
          f"L={args.layers}, S={args.seq}, global batch B={args.batch} ({args.batch * args.seq} tokens), G={g}, "
          f"{args.dtype}, {args.backend}{' + recompute_experts' if args.recompute_experts else ''}, {args.attention} "
          f"attention; {args.steps} timed rounds; {cpu_line(machine)}")
    label = {"a": f"(a) whole batch, B={args.batch}", "b": f"(b) grad accum {g} x {args.batch // g}",
             "c": f"(c) BTA, {g} tiles of {args.batch // g}"}
    print(f"{'mode':<30} {'tok/s':>8} {'best':>8} {'step ms':>8} {'saved MB':>9} {'attn MB':>8} {'moe MB':>8} "
          f"{'model MB':>9} {'tok/expert':>10}")
    for k in MODES:
        r = rows[k]
        print(f"{label[k]:<30} {r['tokens_per_s']:>8.0f} {r['tokens_per_s_best']:>8.0f} "
              f"{r['step_s_median'] * 1e3:>8.1f} {r['saved_bytes'] / 1e6:>9.2f} "
              f"{r['saved_bytes_attention'] / 1e6:>8.2f} {r['saved_bytes_ffn'] / 1e6:>8.2f} "
              f"{r['saved_bytes_predicted'] / 1e6:>9.2f} {r['tokens_per_expert_gemm']:>10.1f}")
    print(f"(c) vs (b): {ratios['c_over_b_tokens_per_s']:.2f}x tokens/s (best-of: "
          f"{ratios['c_over_b_tokens_per_s_best']:.2f}x), {ratios['c_over_b_saved_bytes']:.2f}x saved bytes; "
          f"(c) vs (a): {ratios['c_over_a_tokens_per_s']:.2f}x tokens/s, {ratios['c_over_a_saved_bytes']:.2f}x "
          f"saved bytes")
    print(f"expert GEMM arithmetic intensity (cost model): (b) {rows['b']['expert_gemm_flops_per_byte']:.1f}, "
          f"(a)/(c) {rows['c']['expert_gemm_flops_per_byte']:.1f} FLOP/B; this CPU's ridge (calibrated matmul "
          f"FLOP/s / copy bandwidth): {ridge:.1f} FLOP/B")
    print("tok/s: median over rounds (best: best round); saved MB: bytes kept for backward, measured with "
          "saved_tensors_hooks, = attn MB (input norm + attention, with one recomputed tile for BTA) + moe MB (norm + "
          "MoE layer) + embedding/LM head/loss; model MB: the cost model's prediction (moetrain.analysis.activations)")
