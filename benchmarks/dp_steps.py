"""Timed training steps of plain data parallelism and FSDP2 ZeRO-3, one ``torchrun`` job (2 gloo ranks on CPU):

    torchrun --standalone --nproc_per_node 2 benchmarks/dp_steps.py --out steps.json [--steps 6] [--layers 4]

What ``benchmarks/before_after.py --base REV dp`` runs once per version and round. It uses only the hooks every
version of the trainer has (``moetrain.parallel.launch.start``, ``build_model``, ``prepare_model``,
``local_batch``, ``train_step``), so an older checkout runs it too. Each variant is built as the trainer builds it:

- ``plain_dp``: 2 replicas (the default ``parallel`` section), ``train.grad_accum`` 1 and 4 (``plain_dp_accum4``);
- ``zero3``: ``parallel.dp_shard=2`` (FSDP2, parameters resharded after forward).

``tiny`` preset shapes with ``--layers`` blocks, fp32, random tokens, one intra-op thread per rank. After
``--warmup`` steps (their LM losses reported), ``--steps`` optimizer steps of each variant are timed between
barriers. Rank 0 writes ``{variant: {"losses", "tokens_per_s", "cpu_ms_per_step"}}`` to ``--out``; CPU time is
both ranks' ``time.process_time`` (all threads), steadier than tokens/s on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

# name -> (parallel overrides, train.grad_accum)
VARIANTS: dict[str, tuple[dict, int]] = {"plain_dp": ({}, 1), "plain_dp_accum4": ({}, 4),
                                         "zero3": ({"dp_shard": 2}, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--layers", type=int, default=4, help="blocks of the tiny-shaped model")
    args = p.parse_args()

    from moetrain.config import build_config
    from moetrain.parallel.launch import start
    from moetrain.train.schedule import build_scheduler
    from moetrain.train.trainer import build_optimizer

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    cpu = torch.device("cpu")
    built = {}
    for name, (parallel, accum) in VARIANTS.items():
        cfg = build_config("tiny", overrides={
            "model": {"n_layers": args.layers}, "train": {"device": "cpu", "grad_accum": accum},
            "parallel": {"timeout_s": 300, **parallel}})
        hooks = start(cfg, "cpu")
        model = hooks.prepare_model(hooks.build_model(cfg.model, cpu, cfg.train.seed))
        opt = build_optimizer(model, cfg)
        gen = torch.Generator().manual_seed(0)
        b, s = cfg.train.batch_size, cfg.data.seq_len

        def batch(gen: torch.Generator = gen, b: int = b, s: int = s, vocab: int = cfg.model.vocab_size):
            x = torch.randint(0, vocab, (b, s + 1), generator=gen)
            return x[:, :-1], x[:, 1:]

        built[name] = (hooks, model, opt, build_scheduler(opt, cfg.train), cfg, hooks.local_batch(batch),
                       b * s * accum)

    def step(name: str):
        hooks, model, opt, sched, cfg, next_batch, _ = built[name]
        return hooks.train_step(model, next_batch, opt, sched, cfg.train, cpu)

    out: dict[str, dict] = {name: {"losses": [float(step(name).lm_loss) for _ in range(args.warmup)]}
                            for name in built}
    for name in built:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step(name)
        used = torch.tensor(time.process_time() - c0, dtype=torch.float64)
        dist.barrier()
        out[name]["tokens_per_s"] = args.steps * built[name][6] / (time.perf_counter() - t0)
        dist.all_reduce(used)  # both ranks' CPU seconds
        out[name]["cpu_ms_per_step"] = 1e3 * float(used) / args.steps
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
