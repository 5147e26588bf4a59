"""``moetrain export RUN_DIR --format hf OUT_DIR``: write a trained run as a Hugging Face checkpoint directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from moetrain.errors import MoetrainError


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a trained run as a Hugging Face checkpoint (loads in transformers)")
    p.add_argument("run_dir", help="a moetrain run directory (its newest valid checkpoint is exported)")
    p.add_argument("--format", choices=["hf"], default="hf", help="hf: transformers' Mixtral / Qwen2-MoE / "
                   "Qwen3-MoE / OLMoE / dots.llm1, chosen from the model's configuration (default)")
    p.add_argument("out_dir", help="output directory (created; must be empty unless --overwrite)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.set_defaults(func=run)


def run(args) -> int:
    from moetrain.commands.run_dir import load_run
    from moetrain.interop.families import family_for
    from moetrain.interop.hf import to_hf

    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise MoetrainError(f"{out}: exists and is not empty; pass --overwrite to replace it")
    config, tokenizer, model = load_run(args.run_dir)
    family = family_for(config.model)  # refuse before touching OUT_DIR
    if out.exists() and args.overwrite:
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    to_hf(model, out, tokenizer=tokenizer, max_shard_size=args.max_shard_size)
    print(f"exported {args.run_dir} as {family.architecture} to {out}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained('{out}')")
    return 0
