"""bf16 on a CPU without native bf16 (issue 20): the 1-layer Mixtral-shaped case, forward + backward, moetrain
(imported with ``from_hf``) vs transformers' ``MixtralForCausalLM`` with the same weights, in fp32 and under
``torch.autocast("cpu", torch.bfloat16)``; the four variants interleaved, medians reported with the CPU model,
its bf16 flags and the bf16 decision of ``moetrain.runtime.cpu``.

    python benchmarks/bf16_cpu.py --steps 5 --out bf16.json
    # an AVX2-only CPU on an AVX-512 / AMX machine: limit every kernel library to AVX2
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/bf16_cpu.py
    # the no-bf16 path forced on a machine that has native bf16
    MOETRAIN_BF16=fp32 python benchmarks/bf16_cpu.py

Shape: hidden 512, expert FFN 1024, 8 experts, top-2, 1 layer, 8 heads, vocabulary 1024, 8 sequences x 512 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def build(vocab: int):
    import transformers

    from moetrain.interop.hf import from_hf

    cfg = transformers.MixtralConfig(hidden_size=512, intermediate_size=1024, num_local_experts=8,
                                     num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=8,
                                     num_key_value_heads=8, vocab_size=vocab, max_position_embeddings=512,
                                     tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(cfg).train()
    ours = from_hf(hf).train()
    return ours, hf


def step(model, ids, hf: bool, bf16: bool) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if hf:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(ids[:, :-1], ids[:, 1:]).loss
    loss.float().backward()
    return time.perf_counter() - t0


def main() -> None:
    from moetrain.runtime.cpu import BF16_ENV, bf16_flags, bf16_support, cpu_model

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--only", default="", help="comma list of variants to run (default all)")
    p.add_argument("--out")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    ours, hf = build(a.vocab)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    variants = {"moetrain fp32": (ours, False, False), "moetrain bf16": (ours, False, True),
                "transformers fp32": (hf, True, False), "transformers bf16": (hf, True, True)}
    if a.only:
        variants = {k: v for k, v in variants.items() if k in a.only.split(",")}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(a.warmup + a.steps):  # interleaved: each round runs every variant once
        for name, (model, is_hf, bf16) in variants.items():
            t = step(model, ids if is_hf else ids, is_hf, bf16)
            if i >= a.warmup:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    s = bf16_support("cpu")
    info = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "bf16_flags": bf16_flags(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()[0], "env": {k: os.environ[k] for k in (
                "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", BF16_ENV) if k in os.environ},
            "moetrain_bf16_decision": {"fast": s.fast, "reason": s.reason},
            "seconds": times, "median_s": med}
    print(f"{info['date']} CPU {info['cpu']} (flags: {', '.join(info['bf16_flags']) or 'no native bf16'}; torch "
          f"{info['torch_cpu_capability']}; env {info['env']}), {info['threads']} threads, load "
          f"{info['load_average']:.1f}")
    print(f"moetrain bf16 decision: {'bf16' if s.fast else 'fp32'} ({s.reason})")
    for k, v in med.items():
        print(f"{k:>18}: median {v:.3f} s  ({', '.join(f'{x:.2f}' for x in times[k])})")
    for dt in ("fp32", "bf16"):
        if f"moetrain {dt}" in med and f"transformers {dt}" in med:
            print(f"{dt}: moetrain is {med[f'transformers {dt}'] / med[f'moetrain {dt}']:.2f}x transformers")
    if "moetrain bf16" in med and "moetrain fp32" in med:
        print(f"moetrain bf16 / fp32 time: {med['moetrain bf16'] / med['moetrain fp32']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
