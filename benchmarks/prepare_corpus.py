"""Prepare a generated corpus larger than the memory limit: peak resident memory and tokenization speed.

Generates ``--size`` of English-like text (words of a Zipf-distributed 30,000-word synthetic vocabulary, documents of
lognormal length, median ~2 KB) as ``.jsonl.zst`` files in a temporary folder, then, ``--rounds`` times, in
interleaved child processes:

* ``prepare``: ``moetrain.data.prepare_data`` on it, as ``moetrain train`` runs it (a tokenizer of ``--vocab``
  tokens trained on the default 16 MB sample, then the streaming tokenization into a fresh cache); reports each
  phase's seconds, the tokenization phase's MB/s (corpus UTF-8 bytes / seconds, reading, decompressing, JSON
  parsing and writing included) and the child's peak resident memory (``getrusage``'s ``ru_maxrss``);
* ``baseline``: HF tokenizers' own ``encode_batch`` (and ``encode_batch_fast``, which the pipeline calls) on the
  same documents, in the same batches of ~4M characters, with the tokenizer ``prepare`` trained; only the encode
  calls are timed (the reading is not), so this is the limit on the same text and cores.

Prints the medians and the ratio (target: prepare >= 80% of ``encode_batch``; peak memory < 1.5 GB), and writes a
JSON record (date, CPU model, commit, command, figures) to ``--record`` (default ``results/<date>-prepare-corpus.json``;
an existing record is never overwritten: a suffix is added).

Usage: ``python benchmarks/prepare_corpus.py --size 2GB`` (``--size 200MB`` for a quick run; ``--keep DIR`` keeps
the generated corpus in DIR and reuses it on the next run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FILE_BYTES = 64_000_000  # text per generated .jsonl.zst file
RSS_LIMIT_BYTES = 1.5e9
TARGET_RATIO = 0.8


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"--size: expected e.g. 2GB or 200MB, got {text!r}")
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])


def generate(folder: Path, size: int, seed: int = 0) -> int:
    """Write ~``size`` bytes of text as .jsonl.zst files into ``folder``; returns the text bytes written."""
    import zstandard

    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = 1.0 / np.arange(1, 27) ** 0.9
    lengths = rng.integers(1, 11, size=30_000)
    vocab = np.array(["".join(rng.choice(letters, n, p=freq / freq.sum())) for n in lengths])
    p_word = 1.0 / np.arange(1, len(vocab) + 1)  # Zipf
    p_word /= p_word.sum()
    written, k = 0, 0
    cctx = zstandard.ZstdCompressor(level=3)
    while written < size:
        path = folder / f"part-{k:05d}.jsonl.zst"
        with open(path, "wb") as raw, cctx.stream_writer(raw) as out:
            in_file = 0
            while in_file < FILE_BYTES and written + in_file < size:
                n_words = np.clip(rng.lognormal(5.8, 0.9, size=256), 5, 20_000).astype(int)
                words = vocab[rng.choice(len(vocab), size=int(n_words.sum()), p=p_word)]
                bounds = np.concatenate([[0], np.cumsum(n_words)])
                lines = []
                for d in range(len(n_words)):
                    w = words[bounds[d] : bounds[d + 1]].tolist()
                    for j in range(12, len(w), 12):  # sentences
                        w[j - 1] += "."
                    text = " ".join(w) + ".\n"
                    lines.append(json.dumps({"text": text, "id": f"{k}-{d}"}))
                    in_file += len(text)
                out.write(("\n".join(lines) + "\n").encode())
            written += in_file
        k += 1
    return written


PREPARE = r"""
import json, resource, sys, time
from moetrain.data import DataConfig, prepare_data
folder, cache, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = []
t0 = time.perf_counter()
data = prepare_data(DataConfig(path=folder, cache_dir=cache), vocab, log=lines.append)
wall = time.perf_counter() - t0
print(json.dumps({"lines": lines, "wall_s": wall, "entry": str(data.cache_path),
                  "tokens": int(len(data.train_tokens) + len(data.val_tokens)),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

BASELINE = r"""
import json, resource, sys, time
from pathlib import Path
from tokenizers import Tokenizer
from moetrain.data import discover_files, iter_documents
from moetrain.data.prepare import _ENCODE_CHUNK_CHARS
folder, entry, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = Tokenizer.from_file(str(Path(entry) / "tokenizer.json"))
seconds = {"encode_batch": 0.0, "encode_batch_fast": 0.0}
nbytes, batch, chars = 0, [], 0
def run(batch):
    for name in (("encode_batch", "encode_batch_fast") if len(run.calls) % 2 == 0 else
                 ("encode_batch_fast", "encode_batch")):  # alternate which goes first
        t0 = time.perf_counter()
        getattr(tok, name)(batch, add_special_tokens=False)
        seconds[name] += time.perf_counter() - t0
    run.calls.append(1)
run.calls = []
total = 0
for doc in iter_documents(discover_files(folder)):
    size = len(doc.text.encode())
    total += size
    if nbytes >= limit:
        continue  # only counted
    batch.append(doc.text); chars += len(doc.text); nbytes += size
    if chars >= _ENCODE_CHUNK_CHARS:
        run(batch); batch, chars = [], 0
if batch:
    run(batch)
print(json.dumps({"bytes": nbytes, "corpus_bytes": total, "seconds": seconds}))
"""


def child(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def phase_seconds(lines: list[str]) -> dict[str, float]:
    """Seconds of each phase, from prepare_data's log lines."""
    found = {}
    for name, pattern in (("scan", r"data: read .* in ([\d.]+) s;"), ("train_tokenizer", r"tokenizer on .* in ([\d.]+) s"),
                          ("tokenize", r"data: tokenized .* in ([\d.]+) s")):
        m = next((re.search(pattern, ln) for ln in lines if re.search(pattern, ln)), None)
        if m:
            found[name] = float(m.group(1))
    return found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("2GB"), help="corpus text to generate (2GB)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved prepare / baseline rounds (medians)")
    ap.add_argument("--vocab", type=int, default=8192, help="tokenizer vocabulary (cpu-small's 8192)")
    ap.add_argument("--baseline-size", dest="baseline_bytes", type=parse_size,
                    help="time HF's encode calls on the first this much of the text only (default: all of it)")
    ap.add_argument("--keep", type=Path, help="generate into (or reuse) this folder instead of a temporary one")
    ap.add_argument("--record", type=Path, help="JSON record to write (default results/<date>-prepare-corpus.json)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="moetrain-prepare-"))
    folder = args.keep or work / "corpus"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.glob("*.jsonl.zst")):
            t0 = time.perf_counter()
            text = generate(folder, args.size)
            print(f"generated {text / 1e6:,.0f} MB of text in {time.perf_counter() - t0:.0f} s -> {folder}", flush=True)
        on_disk = sum(p.stat().st_size for p in folder.glob("*.jsonl.zst"))
        prepared, baselines = [], []
        for r in range(args.rounds):
            cache = work / f"cache-{r}"
            prepared.append(child(PREPARE, str(folder), str(cache), str(args.vocab)))
            print(f"round {r + 1} prepare: " + "; ".join(prepared[-1]["lines"]), flush=True)
            baselines.append(child(BASELINE, str(folder), prepared[-1]["entry"], str(args.baseline_bytes or 2**62)))
            print(f"round {r + 1} baseline: {baselines[-1]}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
        nbytes = baselines[0]["corpus_bytes"]
        phases = [phase_seconds(p["lines"]) for p in prepared]
        mbps = statistics.median(nbytes / 1e6 / ph["tokenize"] for ph in phases)
        base = {name: statistics.median(b["bytes"] / 1e6 / b["seconds"][name] for b in baselines)
                for name in ("encode_batch", "encode_batch_fast")}
        peak = max(p["peak_rss_bytes"] for p in prepared)
        figures = {
            "corpus_text_bytes": nbytes, "baseline_text_bytes": baselines[0]["bytes"], "corpus_files": len(list(folder.glob("*.jsonl.zst"))),
            "corpus_zst_bytes": on_disk, "tokens": prepared[0]["tokens"], "vocab": args.vocab, "rounds": args.rounds,
            "cores": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
            **{f"phase_{k}_s_median": statistics.median(ph[k] for ph in phases) for k in phases[0]},
            "prepare_wall_s_median": statistics.median(p["wall_s"] for p in prepared),
            "tokenize_mb_per_s": round(mbps, 2),
            "hf_encode_batch_mb_per_s": round(base["encode_batch"], 2),
            "hf_encode_batch_fast_mb_per_s": round(base["encode_batch_fast"], 2),
            "ratio_to_encode_batch": round(mbps / base["encode_batch"], 3),
            "ratio_to_encode_batch_fast": round(mbps / base["encode_batch_fast"], 3),
            "peak_rss_bytes": peak,
        }
        print(json.dumps(figures, indent=1))
        print(f"tokenization {mbps:.2f} MB/s = {mbps / base['encode_batch']:.0%} of HF encode_batch "
              f"({base['encode_batch']:.2f} MB/s), {mbps / base['encode_batch_fast']:.0%} of encode_batch_fast "
              f"({base['encode_batch_fast']:.2f} MB/s) on {os.cpu_count()} cores ({cpu_model()}); peak RSS "
              f"{peak / 1e9:.2f} GB (limit {RSS_LIMIT_BYTES / 1e9:.1f}) -> "
              f"{'PASS' if mbps >= TARGET_RATIO * base['encode_batch'] and peak < RSS_LIMIT_BYTES else 'FAIL'}")
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        today = dt.date.today().isoformat()
        record = {"title": f"Corpus preparation of {nbytes / 1e6:.0f} MB of text in .jsonl.zst: tokenization against HF "
                           "tokenizers' encode_batch, peak resident memory",
                  "section": "Data", "date": today, "benchmark": "prepare-corpus", "cpu": cpu_model(), "commit": commit,
                  "command": "python benchmarks/prepare_corpus.py " + " ".join(sys.argv[1:]), "figures": figures}
        path = args.record or ROOT / "results" / f"{today}-prepare-corpus.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        k = 1
        while path.exists():  # never overwrite an earlier record
            k += 1
            path = path.with_name(f"{today}-prepare-corpus-{k}.json")
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"record: {path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
