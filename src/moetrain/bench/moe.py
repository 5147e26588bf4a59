"""``moetrain bench moe``: forward + backward of one MoE layer against the dense limit and transformers' MoE block.

Legend: T = tokens, D = hidden, E = experts, K = top-k, F = expert FFN hidden.

For each shape and dtype, in one process and interleaved (see moetrain/bench/common.py), the candidates are:

- ``dense``: the limit. A dense SwiGLU with the experts' weight shapes (gate/up fused [2F, D], down [D, F]) run on
  T * K rows: exactly the active FLOPs of the MoE layer (18 * T * K * D * F for forward + backward) with no
  routing, no permutation and plain PyTorch autograd (``F.linear``, ``silu``, ``*``). (A SwiGLU of width K * F over
  the T tokens does the same FLOPs; the T * K-row form is chosen because its GEMMs have the same shapes as the
  experts', so the ratio isolates what the sparse layer adds: routing, permutation, grouping, combine.)
- ``hf-eager`` and ``hf-grouped_mm``: transformers' ``MixtralSparseMoeBlock`` built from a ``MixtralConfig`` of
  the same shape with ``experts_implementation`` set to ``eager`` (a Python loop over experts) or ``grouped_mm``
  (sort + ``torch.nn.functional.grouped_mm``). Its ``batched_mm`` implementation is not run: it gathers a weight
  matrix per row ([T * K, 2F, D]; 34 GB at the headline shape).
- ``loop``, ``padded``, ``grouped_mm``, ``fused``: moetrain's :class:`~moetrain.moe.layer.MoELayer` with each
  expert backend (``model.execution.moe_backend``); the layer also computes its aux losses and counts,
  transformers' block does not.

All MoE candidates get the same input, router and expert weights (transformers' layout is moetrain's), and the
backward starts from the same upstream gradient. bf16 means weights and activations in bf16 (moetrain's router
still computes in fp32). Each candidate's output is checked against ``loop`` (``max_rel_err``) so a fast wrong
answer cannot pass unnoticed; transformers' bf16 router may pick differently on near-ties, which shows there.

Reported per candidate: median and min-max seconds, the ratio of medians to ``dense``, GFLOP/s of the active
expert FLOPs, and the peak of torch tensor bytes during one forward + backward (moetrain/bench/common.py).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from moetrain.bench import add_measurement_args, choose, write_report
from moetrain.errors import ConfigError

CANDIDATES = ("dense", "hf-eager", "hf-grouped_mm", "loop", "padded", "grouped_mm", "fused")
DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: E experts, top-K, hidden D, expert FFN F, T tokens."""

    experts: int
    top_k: int
    hidden: int
    ffn: int
    tokens: int

    @property
    def flops(self) -> int:
        """Active expert FLOPs of forward + backward: 3 GEMMs of 2 * T*K * D * F each way, backward twice."""
        return 18 * self.tokens * self.top_k * self.hidden * self.ffn

    def label(self) -> str:
        return f"E={self.experts} K={self.top_k} D={self.hidden} F={self.ffn} T={self.tokens}"


# standard: the table of docs/performance.md. Its three shapes have equal active FLOPs (K * F * D = 1M):
# Mixtral-like coarse experts, and fine-grained experts (OLMoE / Qwen3-MoE style) where each expert sees 8x fewer rows.
GRIDS = {
    "standard": [Shape(8, 2, 512, 1024, 4096), Shape(64, 8, 512, 256, 4096), Shape(128, 8, 1024, 128, 4096)],
    "tokens": [Shape(8, 2, 512, 1024, 1024), Shape(8, 2, 512, 1024, 16384), Shape(64, 8, 512, 256, 1024),
               Shape(64, 8, 512, 256, 16384)],
    "smoke": [Shape(4, 2, 32, 16, 64), Shape(8, 3, 32, 8, 48)],
}
GRIDS["full"] = GRIDS["standard"] + GRIDS["tokens"]


def _grid_name(text: str) -> str:
    """``--grid``'s value; ``readme``, the standard grid's name in earlier scripts, is still accepted."""
    return "standard" if text == "readme" else text


def add_parser(sub) -> None:
    p = sub.add_parser("moe", help="one MoE layer vs the dense limit and transformers' MixtralSparseMoeBlock")
    p.add_argument("--grid", choices=sorted(GRIDS), default="standard", type=_grid_name,
                   help="shape grid: standard (default; 4096 tokens through Mixtral-like 8x top-2 experts and "
                        "fine-grained 64 and 128 experts top-8, all with the same active FLOPs), tokens (1k and 16k "
                        "tokens), full (both), smoke (tiny, for tests)")
    p.add_argument("--shape", action="append", default=None, metavar="E,K,D,F,T",
                   help="a shape instead of the grid (repeatable), e.g. 8,2,512,1024,4096")
    p.add_argument("--dtype", choices=[*DTYPES, "both"], default="both")
    p.add_argument("--candidates", default=",".join(CANDIDATES),
                   help=f"comma-separated subset of {','.join(CANDIDATES)} (dense is always run)")
    p.add_argument("--reps", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--vary-routing", action="store_true",
                   help="new random tokens every call (as in training: routing, hence the per-expert GEMM shapes, "
                        "change each step); default: the same tokens every round")
    add_measurement_args(p)
    p.set_defaults(func=run)


def _shapes(args) -> list[Shape]:
    if not args.shape:
        return GRIDS[args.grid]
    shapes = []
    for text in args.shape:
        try:
            e, k, d, f, t = (int(v) for v in text.split(","))
        except ValueError:
            raise ConfigError(f"--shape: expected E,K,D,F,T (five integers), got {text!r}") from None
        if min(e, k, d, f, t) < 1 or k > e:
            raise ConfigError(f"--shape: need all values >= 1 and K <= E, got {text!r}")
        shapes.append(Shape(e, k, d, f, t))
    return shapes


def _candidates(args) -> list[str]:
    names = choose(args.candidates, CANDIDATES, "candidates")
    return ["dense"] + [n for n in CANDIDATES if n in names and n != "dense"]


def _build(shape: Shape, dtype, names: list[str], seed: int, vary_routing: bool = False, device: str = "cpu"):
    """name -> (step() doing forward + backward, output() returning the [T, D] output), sharing weights. With
    ``vary_routing`` every MoE step first overwrites its input with the next of a pool of random token batches (the
    same sequence for every candidate; the dense limit has no routing and keeps its input). Everything is drawn on
    the CPU (the same numbers on every device) and then moved to ``device``."""
    import torch
    import torch.nn.functional as F

    from moetrain.execution import ExecutionConfig
    from moetrain.moe.config import ExpertsConfig, MoEConfig
    from moetrain.moe.layer import MoELayer

    e, k, d, f, t = shape.experts, shape.top_k, shape.hidden, shape.ffn, shape.tokens
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(e, d, generator=g) * d**-0.5  # logits of O(1): a realistic spread of routing scores
    gate_up = torch.randn(e, 2 * f, d, generator=g) * d**-0.5
    down = torch.randn(e, d, f, generator=g) * f**-0.5
    x = torch.randn(t, d, generator=g).to(device, dtype)
    grad_out = torch.randn(t, d, generator=g).to(device, dtype)
    built: dict[str, tuple[Callable[[], None], Callable[[], Any] | None]] = {}

    if "dense" in names:
        dense_w = [gate_up[0].to(device, dtype).requires_grad_(), down[0].to(device, dtype).requires_grad_()]
        x_rows = torch.randn(t * k, d, generator=g).to(device, dtype).requires_grad_()
        grad_rows = torch.randn(t * k, d, generator=g).to(device, dtype)

        def dense_forward():
            gate, up = F.linear(x_rows, dense_w[0]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, dense_w[1])

        built["dense"] = (_stepper(dense_forward, grad_rows, [x_rows, *dense_w]), None)  # no routing to vary

    layers: dict[str, tuple[Any, Any, Callable[[Any, Any], Any]]] = {}  # name -> (module, router weight, call)
    for impl in ("eager", "grouped_mm"):
        if f"hf-{impl}" not in names:
            continue
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        # experts_implementation: taken by PreTrainedConfig's **kwargs (transformers >= 5); MixtralConfig's typed
        # dataclass __init__ does not declare it.
        cfg = MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k,
                            router_jitter_noise=0.0, experts_implementation=impl)  # type: ignore[call-arg]
        block = MixtralSparseMoeBlock(cfg)
        layers[f"hf-{impl}"] = (block, block.gate.weight, lambda m, xin: m(xin.view(1, t, d)).view(t, d))
    for backend in ("loop", "padded", "grouped_mm", "fused"):
        if backend in names:
            layer = MoELayer(d, MoEConfig(num_experts=e, top_k=k, experts=ExpertsConfig(ffn_hidden=f)),
                             ExecutionConfig(moe_backend=backend))
            layers[backend] = (layer, layer.router.weight, lambda m, xin: m(xin)[0])
    for name, (module, gate, call) in layers.items():  # transformers' expert layout is moetrain's
        with torch.no_grad():
            gate.copy_(router)
            module.experts.gate_up_proj.copy_(gate_up)
            module.experts.down_proj.copy_(down)
        module = module.to(device, dtype).train()
        xin = x.clone().requires_grad_()

        def forward(module=module, xin=xin, call=call):
            return call(module, xin)

        built[name] = (_stepper(forward, grad_out, [xin, *module.parameters()],
                                _refresher(xin, seed, vary_routing)), forward)
    return built


VARY_POOL = 16  # distinct token batches cycled through by --vary-routing


def _refresher(leaf, seed: int, enabled: bool):
    """With ``enabled``: a function copying the next of :data:`VARY_POOL` pre-drawn N(0, 1) batches into ``leaf``
    (in place; drawn up front so that the timed step only pays a copy), else ``None``."""
    if not enabled:
        return None
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    pool = itertools.cycle([torch.randn(leaf.shape, generator=gen).to(leaf.device, leaf.dtype)
                            for _ in range(VARY_POOL)])

    def refresh():
        with torch.no_grad():
            leaf.copy_(next(pool))

    return refresh


def _stepper(forward, grad, leaves, refresh=None):
    def step():
        if refresh is not None:
            refresh()
        for leaf in leaves:
            leaf.grad = None
        forward().backward(grad)

    return step


def _rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def bench_shape(shape: Shape, dtype_name: str, names: list[str], reps: int, warmup: int, memory: bool,
                seed: int, clock: str = "wall", vary_routing: bool = False, device: str = "cpu") -> dict:
    """Time (and measure) every candidate on one shape and dtype; returns the JSON-ready record."""
    import torch

    from moetrain.bench.common import interleaved_times, peak_tensor_bytes, summary

    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    built = _build(shape, dtype, names, seed, vary_routing, device)
    sync = torch.cuda.synchronize if device == "cuda" else None
    errors = {}
    if "loop" in built:
        with torch.no_grad():
            ref = built["loop"][1]()
            for name, (_, output) in built.items():
                if output is not None:
                    errors[name] = _rel_err(output(), ref)
    times = interleaved_times({n: s for n, (s, _) in built.items()}, rounds=reps, warmup=warmup, sync=sync,
                              clock=clock)
    dense_median = statistics.median(times["dense"])
    rows: dict[str, dict[str, Any]] = {}  # JSON-ready: floats, the times list, None
    for name in built:
        s = summary(times[name])
        rows[name] = {
            **s,
            "times_s": times[name],
            "ratio_to_dense": s["median_s"] / dense_median,
            "gflops": shape.flops / s["median_s"] / 1e9,
            "peak_bytes": peak_tensor_bytes(built[name][0], device) if memory else None,
            "max_rel_err_vs_loop": errors.get(name),
        }
    best_hf = min((rows[n]["median_s"] for n in ("hf-eager", "hf-grouped_mm") if n in rows), default=None)
    for row in rows.values():
        row["speedup_vs_best_hf"] = best_hf / row["median_s"] if best_hf else None
    return {"shape": asdict(shape), "label": shape.label(), "dtype": dtype_name, "active_gflop": shape.flops / 1e9,
            "candidates": rows}


def print_record(rec: dict) -> None:
    print(f"\n{rec['label']}  {rec['dtype']}  ({rec['active_gflop']:.1f} GFLOP fwd+bwd active)")
    print(f"  {'candidate':<14} {'median ms':>10} {'min-max ms':>17} {'/dense':>7} {'GFLOP/s':>8} "
          f"{'vs best HF':>10} {'peak MB':>8} {'rel err':>8}")
    for name, r in rec["candidates"].items():
        peak = f"{r['peak_bytes'] / 2**20:8.1f}" if r["peak_bytes"] is not None else f"{'-':>8}"
        err = f"{r['max_rel_err_vs_loop']:8.1e}" if r["max_rel_err_vs_loop"] is not None else f"{'-':>8}"
        hf = f"{r['speedup_vs_best_hf']:9.2f}x" if r["speedup_vs_best_hf"] else f"{'-':>10}"
        print(f"  {name:<14} {r['median_s'] * 1e3:10.1f} {r['min_s'] * 1e3:8.1f}-{r['max_s'] * 1e3:<8.1f} "
              f"{r['ratio_to_dense']:7.2f} {r['gflops']:8.1f} {hf} {peak} {err}", flush=True)


def _warn_if_busy(info: dict) -> None:
    """Multi-threaded timings on a machine whose cores other processes keep busy measure the scheduler: every
    parallel region waits for its last thread to get a time slice (several ms each), so implementations that run
    many small ops look far slower than they are."""
    load, cpus, threads = (info["load_avg_1_5_15min"] or [0])[0], info["cpus"] or 1, info["threads"]
    if threads > 1 and load > max(cpus - threads, 0) + 0.5:
        print(f"warning: load average {load:.1f} on {cpus} CPUs: other processes compete for the cores this run "
              f"uses with {threads} threads; timings of many-op candidates will be inflated (try --threads 1 "
              f"--clock cpu, or a quieter moment)")


def run(args) -> int:
    from moetrain.bench.common import cpu_line, machine_info

    shapes, names = _shapes(args), _candidates(args)
    dtypes = DTYPES if args.dtype == "both" else (args.dtype,)
    info = machine_info()
    print(f"bench moe: {len(shapes)} shapes x {list(dtypes)}, {args.reps} timed rounds (+{args.warmup} warm-up), "
          f"candidates interleaved, {'new tokens every call' if args.vary_routing else 'the same tokens every round'}"
          f"; {args.device}{' (' + str(info['cuda']) + ')' if args.device == 'cuda' else ''}, "
          f"{info['threads']} threads, {args.clock} clock; load average "
          f"{info['load_avg_1_5_15min']} on {info['cpus']} CPUs; {cpu_line(info)}")
    if args.device == "cpu":
        _warn_if_busy(info)
    records = []
    for shape in shapes:
        for dtype_name in dtypes:
            rec = bench_shape(shape, dtype_name, names, args.reps, args.warmup, not args.no_memory, args.seed,
                              args.clock, args.vary_routing, args.device)
            print_record(rec)
            records.append(rec)
    end = machine_info()["load_avg_1_5_15min"]
    print(f"\nload average at end {end}")
    write_report(args, {"machine": {**info, "load_avg_at_end": end}, "results": records,
                        "dense_limit": "dense SwiGLU with one expert's weight shapes on T*K rows, plain autograd"})
    return 0
