"""``moetrain upcycle DENSE_HF_DIR OUT --experts E --top-k K``: sparse upcycling of a dense Hugging Face
checkpoint (Llama / Mistral / Qwen2 / Qwen3) into an MoE one that computes the same function at initialisation."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("upcycle", help="turn a dense HF checkpoint into an MoE (experts = copies of the dense FFN)")
    p.add_argument("dense_dir", help="a dense Hugging Face checkpoint directory (llama, mistral, qwen2, qwen3)")
    p.add_argument("out_dir", help="output directory for the MoE checkpoint (must not exist or be empty)")
    p.add_argument("--experts", type=int, required=True, help="experts per MoE layer E")
    p.add_argument("--top-k", type=int, required=True, help="experts per token K (gating weights renormalised)")
    p.add_argument("--router-std", type=float, default=0.02, help="router init std (default 0.02)")
    p.add_argument("--seed", type=int, default=0, help="seed of the router initialisation")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB")
    p.set_defaults(func=run)


def run(args) -> int:
    from moetrain.commands.export import quiet_progress_unless_tty
    from moetrain.configlib import parse_size
    from moetrain.interop.upcycle import upcycle_hf

    quiet_progress_unless_tty()
    out = upcycle_hf(args.dense_dir, args.out_dir, args.experts, args.top_k, args.router_std, args.seed,
                     parse_size(args.max_shard_size, "--max-shard-size"))
    print(f"upcycled {args.dense_dir} into {out} ({args.experts} experts, top-{args.top_k}); fine-tune it with: "
          f"moetrain train --init-from {out} --data CORPUS")
    return 0
