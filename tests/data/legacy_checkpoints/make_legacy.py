"""Writes tests/data/legacy_checkpoints/ with the code of commit b137dba (before TrainState / Checkpointer)."""
import json, shutil, sys
from pathlib import Path
import torch
sys.path.insert(0, "tests")
from conftest import sample_text
from moetrain.cli import main

out = Path(sys.argv[1]); shutil.rmtree(out, ignore_errors=True); out.mkdir(parents=True)
corpus = out / "corpus.txt"; corpus.write_bytes(sample_text(20_000))
run = out / "single"
args = ["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--no-progress", "--steps", "5",
        f"data.cache_dir={out/'cache'}", "data.seq_len=16", "model.vocab_size=300", "model.hidden=16",
        "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=32", "model.moe.expert_ffn_hidden=16",
        "model.moe.expert_bias=true", "train.batch_size=2", "train.log_every=1", "train.ckpt_every=3",
        "train.eval_every=0", "train.eval_batches=1", "train.threads=1", "monitor.tb_heatmap=false",
        "monitor.tb_histograms=false"]
assert main(args + ["--stop-at-step", "3"]) == 0
args[args.index(str(run))] = str(out / "reference")
assert main(args) == 0
