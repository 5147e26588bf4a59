#!/usr/bin/env bash
# The prepared GPU check of the performance issue: one command for a session that is lent a CUDA machine
# (the `device` tool, /work/.library/device/README.md):
#
#     run(command="bash benchmarks/gpu_check.sh", timeout_s=540)
#
# It needs no install (the machine reaches no package registry): it runs the machine's own python3 / PyTorch with
# this checkout's src/ on PYTHONPATH, and writes the printed tables and the JSON results under $OUT (./gpu_check
# elsewhere). Every step is time-boxed so that the whole check ends well inside one call; a step that fails or runs
# out of time leaves the others' results.
#
# What it measures, on the GPU, all in bf16:
#   1. the MoE layer (forward + backward) at the README shapes: moetrain's `fused` (grouped GEMM) and `grouped_mm`
#      backends against the dense cuBLAS limit and transformers' `grouped_mm` block; TFLOP/s = GFLOP/s / 1000;
#   2. the same at Mixtral 8x7B's layer shape (E=8, K=2, D=4096, F=14336) on 8192 tokens;
#   3. full training steps of the cpu-small model on a 64 x 256 batch against MixtralForCausalLM.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-gpu_check}"
mkdir -p "$out"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep its output, never stop the script
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

step env 60 python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda",
    torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")'
step bench_moe_grid 180 python3 -m moetrain bench moe --device cuda --dtype bf16 --grid readme \
    --candidates dense,hf-grouped_mm,grouped_mm,fused --reps 20 --warmup 5 --json "$out/bench_moe_grid.json" --overwrite
step bench_moe_mixtral 150 python3 -m moetrain bench moe --device cuda --dtype bf16 --shape 8,2,4096,14336,8192 \
    --candidates dense,hf-grouped_mm,fused --reps 10 --warmup 3 --json "$out/bench_moe_mixtral.json" --overwrite
step bench_train 120 python3 -m moetrain bench train --device cuda --dtype bf16 --batch 64 --steps 10 --warmup 3 \
    --json "$out/bench_train.json" --overwrite
