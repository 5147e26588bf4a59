"""``moetrain plan --preset NAME --devices N --device h100``: candidate parallel layouts, their memory per device,
estimated step time and communication share, and the recommended layout and BTA tile count, with the reason."""

from __future__ import annotations

from pathlib import Path

from moetrain.errors import ConfigError, MoetrainError


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="parallel layout and BTA plan for a model on N devices (cost model)")
    p.add_argument("--preset", help="model preset, e.g. mixtral-8x7b, qwen3-30b-a3b, olmoe-1b-7b (default cpu-small)")
    p.add_argument("--config", help="a .toml or .json file of config fields (applied over the preset)")
    p.add_argument("--devices", type=int, required=True, help="number of devices N")
    p.add_argument("--device", default="h100",
                   help="h100 | h200 | trn1 | cpu (calibrated now) | a .json/.toml hardware file (default h100)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default: 4096, or the model's context length if shorter)")
    p.add_argument("--global-batch", type=int, default=1024, help="sequences per optimizer step (default 1024)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="compute dtype (default bf16)")
    p.add_argument("--all", action="store_true", help="show every candidate, not only the best per family")
    p.add_argument("--sources", action="store_true", help="print where each hardware figure comes from")
    p.add_argument("--emit", metavar="FILE.toml",
                   help="write the recommended layout as a run config for `moetrain train --config FILE` (torchrun "
                        "with --devices processes; check it with `moetrain train --config FILE --dry-run "
                        "--world-size N`)")
    p.add_argument("--overwrite", action="store_true", help="let --emit replace an existing FILE")
    p.add_argument("overrides", nargs="*", metavar="FIELD=VALUE", help="config overrides, e.g. model.moe.top_k=1")
    p.set_defaults(func=run)


def run(args) -> int:
    from moetrain.analysis.hardware import get_hardware
    from moetrain.analysis.params import count_params
    from moetrain.analysis.planner import plan
    from moetrain.analysis.shape import ModelShape
    from moetrain.config import build_config
    from moetrain.commands import check_at_least, check_output_path
    from moetrain.configlib import load_file, parse_overrides

    check_at_least(args, 1, "devices", "seq", "global_batch")
    if args.emit:
        emit = Path(args.emit)
        check_output_path(emit, "--emit", kind="file")
        if emit.exists() and not args.overwrite:
            raise MoetrainError(f"--emit {emit}: exists; pass --overwrite to replace it, or choose another --emit")
    file_data = load_file(args.config) if args.config else None
    config = build_config(args.preset, file_data, parse_overrides(args.overrides))
    model = config.model
    if args.seq is None:
        args.seq = min(4096, model.max_seq_len)
    if args.seq > model.max_seq_len:
        raise ConfigError(f"--seq: {args.seq} exceeds model.max_seq_len={model.max_seq_len}")
    hw = get_hardware(args.device)
    shape = ModelShape.from_config(model)
    counts = count_params(shape)
    flags = [model.is_moe_layer(i) for i in range(model.n_layers)]
    act_bytes = 2 if args.dtype == "bf16" else 4
    result = plan(shape, flags, args.devices, hw, args.seq, args.global_batch, act_bytes)

    print(f"model   {config.preset}: {_params(counts.total)} parameters ({_params(counts.active)} active), "
          f"{shape.num_experts} experts top-{shape.top_k}, {shape.moe_layers} MoE of {shape.n_layers} blocks")
    print(f"devices {args.devices} x {hw.name}: {_si(hw.peak_flops, 'FLOP/s')} peak, {hw.mem_bytes / 1e9:.0f} GB, "
          f"{_si(hw.mem_bw, 'B/s')}, links {_si(hw.intra_bw, 'B/s')} / {_si(hw.inter_bw, 'B/s')} "
          f"(intra / inter node, per direction), {hw.efficiency:.0%} of peak assumed sustained")
    print(f"step    {args.global_batch} x {args.seq} tokens ({args.global_batch * args.seq / 1e6:.2f}M), "
          f"{args.dtype} autocast, fp32 weights + grads + AdamW (16 B/param), optimizer sharded over data-parallel "
          f"ranks (ZeRO-1)")
    if args.sources:
        for k, v in hw.sources.items():
            print(f"  {k}: {v}")
    print()
    header = (f"{'layout':<18} {'family':<6} {'fits':<4} {'GB/dev':>7} {'micro':>5} {'G':>3} {'ckpt':>4} "
              f"{'tok/exp':>8} {'F/B':>6} {'step s':>8} {'comm':>5}")
    print(header)
    print("-" * len(header))
    shown = result.candidates if args.all else _best_per_family(result.candidates)
    for c in shown:
        e = c.best or c.smallest
        mark = "*" if c is result.recommended else " "
        print(f"{mark}{c.layout.label:<17} {c.layout.family:<6} {'yes' if c.fits else 'no':<4} "
              f"{e.memory / 1e9:>7.1f} {e.workload.micro_batch:>5} {e.workload.bta_tiles:>3} "
              f"{_ckpt(e.workload):>4} {e.tokens_per_expert:>8.0f} {e.expert_intensity:>6.0f} "
              f"{e.step_s:>8.2f} {e.comm_share:>5.0%}")
    print()
    if result.recommended is None:
        print(f"recommended: none. {result.reason}")
        if args.emit:  # an error, so that `plan --emit F && torchrun ... --config F` cannot train an older F
            raise ConfigError(f"--emit: no layout to write ({result.reason}); {args.emit} was not written")
        return 0
    r = result.recommended.best
    assert r is not None  # plan() recommends only a fitting candidate
    ckpt = _ckpt(r.workload)
    ckpt = "off, experts recomputed (model.execution.recompute_experts=true)" if ckpt == "exp" else ckpt
    print(f"recommended: {result.recommended.layout.label}, micro-batch {r.workload.micro_batch} x "
          f"{r.grad_accum} accumulation steps, activation checkpointing {ckpt}: "
          f"{r.memory / 1e9:.1f} GB/device, ~{r.step_s:.2f} s/step, {r.comm_share:.0%} communication")
    print(f"  why: {result.reason}")
    print(f"  {result.bta_reason}")
    for note in result.notes:
        print(f"  note: {note}")
    print("  (estimates from moetrain.analysis: roofline compute, 1F1B bubble, exposed all-to-all; see docs/bta.md)")
    _rank_memory(args, config, result.recommended)
    if args.emit:
        _emit(args, config, result.recommended)
    return 0


def _run_config(args, config, candidate) -> dict:
    """The recommendation as run-config data: the preset, the --config file's and the overrides' fields, then the
    layout's trainer fields (:func:`moetrain.analysis.planner.trainer_fields`) and ``train.device`` (``cpu`` for
    ``--device cpu``, else ``cuda``) on top."""
    from moetrain.analysis.planner import trainer_fields
    from moetrain.configlib import load_file, merge, parse_overrides

    data = merge(load_file(args.config) if args.config else {}, parse_overrides(args.overrides))
    data = merge(data, trainer_fields(candidate, args.seq, args.dtype))
    # the device the plan is for: its per-rank memory (CPU-only terms, gloo's copies) is the dry run's only with it
    data = merge(data, {"train": {"device": "cpu" if args.device == "cpu" else "cuda"}})
    return {"preset": config.preset, **{k: v for k, v in data.items() if k != "preset"}}


def _rank_memory(args, config, candidate) -> None:
    """Each rank's parameters, gradients, AdamW state, gathered parameters and activations of the recommended
    layout as the trainer would run it (``moetrain.parallel.memory``, fp32 master weights)."""
    from moetrain.config import build_config
    from moetrain.parallel.memory import memory_lines

    try:
        run = build_config(file_data=_run_config(args, config, candidate))
        lines = memory_lines(run, args.devices)
    except ConfigError as e:  # a layout the planner counts but the trainer refuses: say why, keep the plan
        print(f"  per-rank memory: not available for this layout ({e})")
        return
    p = run.parallel
    print(f"  the trainer shards weights, gradients and AdamW state (FSDP2, dp_shard={p.dp_shard}, ep={p.ep}); the "
          f"table's GB/device counts ZeRO-1 (only AdamW state sharded), an upper bound:")
    for line in lines:
        print(f"  {line}")


def _emit(args, config, candidate) -> None:
    """Write the recommendation (:func:`_run_config`) as a TOML run config."""
    from moetrain.train.checkpoint import write_file_atomic

    data = _run_config(args, config, candidate)
    path = Path(args.emit)
    header = (f"# moetrain plan --preset {config.preset} --devices {args.devices} --device {args.device}: "
              f"{candidate.layout.label}\n# run: torchrun --nproc_per_node ... (WORLD_SIZE {args.devices}) -m moetrain "
              f"train --config {path.name}\n")
    try:
        write_file_atomic(path, (header + _toml(data)).encode())  # a crash leaves the old file or the new one
    except OSError as e:
        raise MoetrainError(f"--emit {path}: cannot write it ({e.strerror})") from None
    print(f"wrote {path}: {candidate.layout.label} as parallel.pp={candidate.layout.pp} ep={candidate.layout.ep} "
          f"dp_shard={candidate.layout.dp} (FSDP2); check it with `moetrain train --config {path} --dry-run "
          f"--world-size {args.devices}`")


def _toml(data: dict, prefix: str = "") -> str:
    """TOML for nested dicts of str / bool / int / float (scalars first, then one table per sub-dict)."""
    import json

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a TOML basic string is a JSON string for the characters used here
        raise ValueError(f"--emit: cannot write {v!r} as TOML")

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    out = ("\n".join(lines) + "\n") if lines else ""
    for k, v in data.items():
        if isinstance(v, dict):
            name = f"{prefix}.{k}" if prefix else k
            body = _toml(v, name)
            scalars = any(not isinstance(x, dict) for x in v.values())
            out += (f"\n[{name}]\n" if scalars else "") + body
    return out


def _best_per_family(cands):
    """The first four candidates of each family (already sorted: fitting and fastest first)."""
    return [c for i, c in enumerate(cands) if sum(d.layout.family == c.layout.family for d in cands[:i]) < 4]


def _ckpt(work) -> str:
    """The table's ckpt column: ``on`` (every block), ``exp`` (only the experts: model.execution.recompute_experts) or
    ``off``."""
    return "on" if work.checkpoint else "exp" if work.recompute_experts else "off"


def _si(value: float, unit: str) -> str:
    """A rate with the SI prefix that puts it in [1, 1000), three significant digits: ``989 TFLOP/s`` for an H100,
    ``24.9 GFLOP/s`` and ``12.3 GB/s`` for a laptop CPU (``B/s`` reads ``GB/s``)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _params(n: int) -> str:
    """A parameter count for a line: billions from 1B up, else millions (tiny's 0.00B was unreadable)."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
