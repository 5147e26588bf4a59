"""A model that does not fit one process trains when sharded over four, under the same per-process memory cap.

    python benchmarks/capacity_demo.py [--cap-gb 1.4] [--data DIR] [--steps 3]

Every process this script starts (``moetrain train``, and ``torchrun`` with its 4 workers) runs under
``RLIMIT_DATA = --cap-gb`` (``resource.setrlimit`` in the child before it starts: the kernel refuses heap and
anonymous mappings beyond it, which PyTorch reports as an allocation failure instead of the OOM killer's SIGKILL).
The model (hidden 512, 4 MoE blocks of 8 experts of width 1536: 80M parameters, 1.28 GB of fp32 weights +
gradients + AdamW state) does not fit next to the ~0.3 GB the interpreter and PyTorch hold. The corpus (default: the
standard library's ``email`` package, ~0.5 MB of Python) is tokenized first, without the cap (the tokenizer's worker
threads reserve address space that is not the model's), into the usual token cache, so a rerun reuses it:

1. one process: ``moetrain train`` refuses before allocating, in one line that names the limit and the layout to
   try (exit status 2);
2. ``torchrun --nproc_per_node 4 ... parallel.dp_shard=4`` (FSDP2 ZeRO-3: each process holds a quarter of the state)
   trains ``--steps`` steps under the same cap, and the loss falls.

Passes on 2 CPU cores (the 4 workers share them; a few minutes). Exit status 0 when both happen. The runs' directories
are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model.hidden=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=1024",
         "model.moe.num_experts=8", "model.moe.experts.ffn_hidden=1536", "model.tie_embeddings=false"]


def _capped(cap_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, cap_bytes))
    return apply


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap-gb", type=float, default=1.4, help="RLIMIT_DATA of every process, GB (default 1.4)")
    ap.add_argument("--data", default=None, help="a text corpus (default: the standard library's email package)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="capacity_demo-") as tmp_name:
        return _demo(args, Path(tmp_name))


def _demo(args: argparse.Namespace, tmp: Path) -> int:
    cap = int(args.cap_gb * 1e9)
    data = args.data or os.path.join(os.path.dirname(os.__file__), "email")
    train = ["-m", "moetrain", "train", "--preset", "tiny", "--data", data, "--no-progress",
             f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0",
             "train.eval_batches=1", "train.batch_size=4", "data.seq_len=32", *MODEL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    from moetrain.config import build_config
    from moetrain.configlib import parse_overrides
    from moetrain.data.dataset import prepare_data

    fields = [*train[train.index("--no-progress") + 1:], f"data.path={data}"]
    config = build_config("tiny", overrides=parse_overrides(fields))
    prepare_data(config.data, config.model.vocab_size, log=lambda _: None)
    print(f"cap: RLIMIT_DATA = {cap / 1e9:.2f} GB per process", flush=True)

    one = subprocess.run([sys.executable, *train, "--out", str(tmp / "one")], capture_output=True, text=True,
                         env=env, preexec_fn=_capped(cap))
    err = [line for line in one.stderr.splitlines() if line.strip()]
    print(f"1 process: exit {one.returncode}: {err[-1] if err else '(no message)'}", flush=True)
    clean = one.returncode == 2 and len(err) == 1 and "parallel.dp_shard=" in err[0] and "RLIMIT_DATA" in err[0]

    four = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr",
                           "127.0.0.1", "--master_port", str(_port()), *train, "--out", str(tmp / "four"),
                           "parallel.dp_shard=4"], capture_output=True, text=True, env=env, preexec_fn=_capped(cap))
    records = []
    if (tmp / "four" / "metrics.jsonl").is_file():
        records = [json.loads(line) for line in (tmp / "four" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    peaks = {k: v for k, v in (records[-1] if records else {}).items() if k.endswith("/peak_bytes")}
    print(f"4 processes, parallel.dp_shard=4: exit {four.returncode}; losses {[round(x, 4) for x in losses]}; "
          f"peak resident memory per rank (GB) {[round(v / 1e9, 2) for v in peaks.values()]}", flush=True)
    trained = four.returncode == 0 and len(losses) == args.steps and losses[-1] < losses[0]
    if not trained:
        print(four.stdout[-2000:] + four.stderr[-4000:], file=sys.stderr)
    print("PASS" if clean and trained else "FAIL")
    return 0 if clean and trained else 1


if __name__ == "__main__":
    sys.exit(main())
