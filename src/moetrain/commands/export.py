"""``moetrain export RUN_DIR --format hf OUT_DIR``: write a trained run as a Hugging Face checkpoint directory.

The checkpoint is written into a temporary sibling directory and renamed to ``OUT_DIR`` at the end, so a failure
leaves no half-written ``OUT_DIR``; ``--overwrite`` replaces only a directory that holds a previous export and
nothing else.
"""

from __future__ import annotations

import re
import shutil
import sys
import uuid
from pathlib import Path

from moetrain.commands import check_output_path
from moetrain.configlib import parse_size
from moetrain.errors import MoetrainError

# What an export writes (transformers' save_pretrained, the generation config and the tokenizer files).
_EXPORT_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
_SHARD = re.compile(r"model(-\d+-of-\d+)?\.safetensors")
def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a trained run as a Hugging Face checkpoint (loads in transformers)")
    p.add_argument("run_dir", help="a moetrain run directory (its newest valid checkpoint is exported)")
    p.add_argument("--format", choices=["hf"], default="hf", help="hf: transformers' Mixtral / Qwen2-MoE / "
                   "Qwen3-MoE / OLMoE / dots.llm1, chosen from the model's configuration (default)")
    p.add_argument("out_dir", help="output directory (created; must be empty unless --overwrite)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors shard, e.g. 5GB (5*10^9 bytes), 500MB or 4GiB (4*2^30)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it holds a previous export (and nothing else)")
    p.set_defaults(func=run)


def _check_previous_export(out: Path, entries: list[Path]) -> None:
    """Refuse to replace ``out`` unless it looks like an export: config.json and safetensors weights, and no file
    an export does not write (so --overwrite cannot delete anything else)."""
    names = {e.name for e in entries}
    has_weights = any(_SHARD.fullmatch(n) for n in names) or "model.safetensors.index.json" in names
    if "config.json" not in names or not has_weights:
        raise MoetrainError(f"--overwrite: {out} does not look like a previous export (no config.json and "
                            "safetensors weights); refusing to delete it")
    other = sorted(e.name + ("/" if e.is_dir() else "") for e in entries
                   if not e.is_file() or not (e.name in _EXPORT_FILES or _SHARD.fullmatch(e.name)))
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise MoetrainError(f"--overwrite: {out} holds files an export does not write ({shown}); refusing to "
                            "delete them: move them away or choose another OUT_DIR")


def quiet_progress_unless_tty() -> None:
    """Turn transformers' progress bars off when stderr is not a terminal: through a pipe or into a log file a bar
    is a line of carriage-return redraws, not progress anyone sees."""
    if not sys.stderr.isatty():
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()


def run(args) -> int:
    from moetrain.commands.run_dir import load_run
    from moetrain.data.dataset import replace_directory
    from moetrain.interop.families import family_for
    from moetrain.interop.hf import to_hf

    quiet_progress_unless_tty()
    out = Path(args.out_dir)
    shard_bytes = parse_size(args.max_shard_size, "--max-shard-size")
    check_output_path(out, "OUT_DIR", overwrite=args.overwrite)
    entries = list(out.iterdir()) if out.is_dir() else []
    if entries:
        _check_previous_export(out, entries)
    config, tokenizer, model, _ = load_run(args.run_dir)
    family = family_for(config.model)  # refuse before touching OUT_DIR

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        to_hf(model, tmp, tokenizer=tokenizer, max_shard_size=shard_bytes)
        replace_directory(tmp, out)  # the previous export goes only once the new one is complete
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {args.run_dir} as {family.architecture} to {out}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained('{out}')")
    return 0
