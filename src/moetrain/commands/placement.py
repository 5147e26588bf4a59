"""``moetrain placement RUN_DIR --ep N --redundant R``: an expert-to-rank map with the hottest experts replicated
(EPLB), from the run's routing statistics, written in SGLang's ``--init-expert-location`` format and in ours
(moetrain/serve/placement.py, docs/serving.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    p = sub.add_parser("placement", help="expert-to-rank placement with replicated hot experts (EPLB; SGLang JSON)")
    p.add_argument("model_dir", help="a moetrain run directory (or a Hugging Face directory with --calibration-text)")
    p.add_argument("--ep", type=int, required=True, help="expert-parallel ranks N")
    p.add_argument("--redundant", type=int, default=0, help="extra expert replicas R per layer (N must divide E and E + R)")
    p.add_argument("--calibration-text", default=None, metavar="FILE",
                   help="count expert usage with a calibration pass over this text (default: the run's "
                   "metrics.jsonl routing statistics)")
    p.add_argument("--out", default=None, metavar="DIR", help="where to write the two JSON files (default: MODEL_DIR)")
    p.add_argument("--overwrite", action="store_true", help="replace the two files of an earlier placement with the "
                   "same --ep and --redundant")
    p.set_defaults(func=run)


def run(args) -> int:
    from moetrain.commands.serve import calibration_usage, moe_blocks
    from moetrain.serve.loader import load_served_model
    from moetrain.serve.placement import LayerPlacement, place, placement_dict, sglang_json
    from moetrain.train.checkpoint import write_file_atomic

    out = Path(args.out or args.model_dir)
    stem = f"placement-ep{args.ep}-r{args.redundant}"
    ours, sgl = out / f"{stem}.json", out / f"{stem}.sglang.json"
    # Checked before the model loads: an earlier placement (perhaps from other usage) is never replaced silently.
    for path in (ours, sgl):
        if path.exists() and not args.overwrite:
            raise MoetrainError(f"{path}: exists (an earlier placement); pass --overwrite to replace it or --out DIR "
                                "to write elsewhere")
    served = load_served_model(args.model_dir)
    blocks, e = moe_blocks(served, args.model_dir)
    usage = calibration_usage(args, served)
    if usage.source == "uniform":
        raise MoetrainError(f"{args.model_dir}: no routing statistics (metrics.jsonl with moe/layer*/tokens); "
                            "pass --calibration-text FILE")
    layers = place(usage.counts, args.ep, args.redundant)
    out.mkdir(parents=True, exist_ok=True)
    # Each file whole or not at all (temp file + rename): `serve --placement` never reads half a file.
    write_file_atomic(ours, json.dumps(placement_dict(layers, blocks, args.ep, args.redundant, e, usage.source),
                                       indent=1).encode())
    write_file_atomic(sgl, json.dumps(sglang_json(layers, blocks, served.model.config.n_layers, e)).encode())
    print(f"expert usage: {usage.source}; {e} experts, {args.redundant} redundant, {args.ep} ranks "
          f"({(e + args.redundant) // args.ep} physical experts per rank)")
    print("predicted load per rank, max / mean (1.00 = balanced):")
    before, after = [], []
    for b, lp in zip(blocks, layers):
        before.append(LayerPlacement.imbalance(lp.load_before))
        after.append(LayerPlacement.imbalance(lp.load_after))
        hot = [x for x in range(e) if lp.replicas[x] > 1]
        print(f"  layer {b}: {before[-1]:.3f} -> {after[-1]:.3f}" + (f"  (replicated: {hot})" if hot else ""))
    print(f"  mean over layers: {sum(before) / len(before):.3f} -> {sum(after) / len(after):.3f}")
    print(f"wrote {ours} (moetrain serve) and {sgl} (sglang --init-expert-location)", file=sys.stderr)
    return 0
