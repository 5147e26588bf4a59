"""Corpus formats (data/formats.py): the same rows as parquet, .jsonl.zst, .json.gz, a `datasets` folder, a
Megatron-Core indexed dataset and a flat .bin give the same token stream, and each trains; errors for what is wrong."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from moetrain.data import DataConfig, prepare_data, train_tokenizer
from moetrain.data.formats import MegatronIndex, ReadStats, find_pretokenized, iter_token_documents
from moetrain.errors import ConfigError, DataError

WORDS = ("the of and to in is was for on that with as by at from his her it an be are this which or have "
         "river stone market winter garden signal engine harbor lantern orchard copper meadow thunder").split()
N_ROWS = 3000
VOCAB = 512  # the tiny preset's model.vocab_size


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def rows() -> list[str]:
    """N_ROWS documents of 5..60 words, with punctuation, digits, newlines and some non-ASCII."""
    rng = random.Random(0)
    out = []
    for i in range(N_ROWS):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 60))]
        if i % 7 == 0:
            words.insert(rng.randrange(len(words)), "café")
        out.append(f"{i}. " + " ".join(words) + (".\n" if i % 3 else "!\nnext line"))
    return out


@pytest.fixture(scope="module")
def formats(rows, tmp_path_factory) -> dict[str, Path]:
    """The rows in every text format, each named `rows` (so every format names record i `rows:i`)."""
    root = tmp_path_factory.mktemp("formats")
    out = {}
    table = pa.table({"id": list(range(len(rows))), "text": rows})
    (root / "parquet").mkdir()
    out["parquet"] = root / "parquet" / "rows.parquet"
    pq.write_table(table, out["parquet"], row_group_size=500)  # 6 row groups, read one at a time
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(rows)).encode()
    (root / "jsonl").mkdir()
    out["jsonl"] = root / "jsonl" / "rows.jsonl"
    out["jsonl"].write_bytes(lines)
    (root / "zst").mkdir()
    out["jsonl.zst"] = root / "zst" / "rows.jsonl.zst"
    out["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(lines))
    (root / "gz").mkdir()
    out["json.gz"] = root / "gz" / "rows.json.gz"
    out["json.gz"].write_bytes(gzip.compress(lines))
    import datasets

    out["datasets"] = root / "rows"
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(out["datasets"]))
    return out


@pytest.fixture(scope="module")
def tokenizer_json(rows, tmp_path_factory) -> Path:
    """A 'pretrained' tokenizer (trained here on the rows), saved as a tokenizer.json."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(rows, VOCAB).save(str(path))
    return path


def _prepare(path: Path, tmp_path: Path, **data) -> object:
    cfg = DataConfig(path=str(path), seq_len=64, val_fraction=0.05, cache_dir=str(tmp_path / "cache"), **data)
    return prepare_data(cfg, VOCAB, log=quiet)


def _ids(tokenizer_json: Path, rows: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return [e.ids for e in tok.encode_batch(rows, add_special_tokens=False)]


def test_every_text_format_gives_the_same_token_stream(formats, tmp_path):
    """Tokenizer trained on the sample, split, tokens: identical for parquet, .jsonl, .jsonl.zst, .json.gz and a
    `datasets` folder of the same rows."""
    prepared = {name: _prepare(path, tmp_path) for name, path in formats.items()}
    ref = prepared["parquet"]
    assert ref.num_train_docs + ref.num_val_docs == N_ROWS and ref.num_val_docs == round(0.05 * N_ROWS)
    for name, data in prepared.items():
        assert data.tokenizer.to_str() == ref.tokenizer.to_str(), name
        np.testing.assert_array_equal(data.train_tokens, ref.train_tokens, err_msg=name)
        np.testing.assert_array_equal(data.val_tokens, ref.val_tokens, err_msg=name)
    # the index: one exclusive end offset per document, at its EOS
    ends = np.fromfile(ref.cache_path / "train.idx", dtype="<i8")
    assert len(ends) == ref.num_train_docs and ends[-1] == len(ref.train_tokens)
    assert np.all(np.asarray(ref.train_tokens)[ends - 1] == ref.eos_id)


def test_pretrained_tokenizer_for_text_and_its_folder_form(formats, tokenizer_json, rows, tmp_path):
    data = _prepare(formats["parquet"], tmp_path, tokenizer=str(tokenizer_json))
    from tokenizers import Tokenizer

    assert data.tokenizer.to_str() == Tokenizer.from_file(str(tokenizer_json)).to_str()  # used, not trained
    stream = np.concatenate([data.train_tokens, data.val_tokens])
    assert sorted(stream.tolist()) == sorted(i for ids in _ids(tokenizer_json, rows) for i in ids + [0])
    folder = _prepare(formats["parquet"], tmp_path, tokenizer=str(tokenizer_json.parent))  # an HF tokenizer folder
    np.testing.assert_array_equal(folder.train_tokens, data.train_tokens)


def test_megatron_indexed_dataset_read_like_megatron_and_like_the_text(formats, tokenizer_json, rows, tmp_path):
    """A .bin/.idx built with megatron-core's own IndexedDatasetBuilder (one document per row, end-of-document
    token appended as preprocess_data.py --append-eod does): moetrain reads the documents Megatron's IndexedDataset
    reads, and prepares the same streams as the parquet of the same rows with the same tokenizer."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    ids = _ids(tokenizer_json, rows)
    prefix = tmp_path / "megatron" / "rows"
    prefix.parent.mkdir()
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for doc in ids:
        builder.add_document(torch.tensor(doc + [0]), [len(doc) + 1])
    builder.finalize(str(prefix) + ".idx")

    theirs = IndexedDataset(str(prefix))
    corpus = find_pretokenized(str(prefix))
    assert corpus is not None and corpus.kind == "megatron"
    ours = list(iter_token_documents(corpus, None, 0, VOCAB, ReadStats()))
    assert len(ours) == len(theirs) == N_ROWS
    for d in (0, 1, 1234, N_ROWS - 1):
        np.testing.assert_array_equal(ours[d].ids, theirs[d][:-1])  # without the appended end-of-document
        assert ours[d].name == f"rows:{d + 1}"
    index = MegatronIndex.read(prefix.with_suffix(".idx"), prefix.with_suffix(".bin"))
    np.testing.assert_array_equal(index.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(index.sequence_lengths, theirs.sequence_lengths)

    text = _prepare(formats["parquet"], tmp_path, tokenizer=str(tokenizer_json))
    for path in (prefix, prefix.with_suffix(".idx"), prefix.with_suffix(".bin")):
        mega = _prepare(path, tmp_path, tokenizer=str(tokenizer_json))
        np.testing.assert_array_equal(mega.train_tokens, text.train_tokens)
        np.testing.assert_array_equal(mega.val_tokens, text.val_tokens)

    # a truncated .bin, ids outside the tokenizer, a dtype that disagrees, no tokenizer
    data = prefix.with_suffix(".bin").read_bytes()
    prefix.with_suffix(".bin").write_bytes(data[:-10])
    with pytest.raises(DataError, match=r"rows\.bin' is truncated: .* its index 'rows\.idx' needs"):
        _prepare(prefix, tmp_path, tokenizer=str(tokenizer_json))
    prefix.with_suffix(".bin").write_bytes(data)
    with pytest.raises(DataError, match="data.token_dtype: 'uint32' does not match .* which holds uint16 ids"):
        _prepare(prefix, tmp_path, tokenizer=str(tokenizer_json), token_dtype="uint32")
    with pytest.raises(DataError, match="is pre-tokenized: set data.tokenizer"):
        _prepare(prefix, tmp_path)
    small = tmp_path / "small.json"
    train_tokenizer(rows[:50], 300).save(str(small))
    with pytest.raises(DataError, match=r"token id \d+ at token [\d,]+ is outside the tokenizer's vocabulary of "):
        _prepare(prefix, tmp_path, tokenizer=str(small))


def test_flat_bin_of_token_ids(formats, tokenizer_json, rows, tmp_path):
    """nanoGPT's train.bin: ids with an end-of-text token after each document, of a stated dtype."""
    ids = _ids(tokenizer_json, rows)
    flat = tmp_path / "flat" / "rows.bin"
    flat.parent.mkdir()
    np.concatenate([np.array(d + [0], dtype=np.uint16) for d in ids]).tofile(flat)
    text = _prepare(formats["parquet"], tmp_path, tokenizer=str(tokenizer_json))
    data = _prepare(flat, tmp_path, tokenizer=str(tokenizer_json), token_dtype="uint16")
    np.testing.assert_array_equal(data.train_tokens, text.train_tokens)
    np.testing.assert_array_equal(data.val_tokens, text.val_tokens)

    with pytest.raises(DataError, match="is a flat binary of token ids: set data.token_dtype"):
        _prepare(flat, tmp_path, tokenizer=str(tokenizer_json))
    # uint16 ids read as uint32 pair up into ids far outside the vocabulary (the file's size may even be odd)
    with pytest.raises(DataError, match=r"outside the tokenizer's vocabulary .*is data.token_dtype=uint32 the type"
                                        r"|not a whole number of uint32 ids"):
        _prepare(flat, tmp_path, tokenizer=str(tokenizer_json), token_dtype="uint32")
    odd = tmp_path / "flat" / "odd.bin"
    odd.write_bytes(flat.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"odd\.bin' has \d+ bytes, not a whole number of uint16 ids"):
        _prepare(odd, tmp_path, tokenizer=str(tokenizer_json), token_dtype="uint16")


def test_one_document_flat_bin_holds_out_its_tail(tokenizer_json, rows, tmp_path):
    ids = np.array([i for d in _ids(tokenizer_json, rows[:400]) for i in d], dtype=np.uint16)  # no EOS at all
    flat = tmp_path / "one.bin"
    ids.tofile(flat)
    data = _prepare(flat, tmp_path, tokenizer=str(tokenizer_json), token_dtype="uint16")
    n_val = round(len(ids) * 0.05)
    np.testing.assert_array_equal(data.train_tokens, np.append(ids[:-n_val], 0))
    np.testing.assert_array_equal(data.val_tokens, np.append(ids[-n_val:], 0))


def test_missing_or_wrong_text_column(rows, tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"content": rows[:200], "n": list(range(200))}), path)
    with pytest.raises(DataError, match=r"c\.parquet' has no column 'text' \(columns: content, n\); set "
                                        r"data.text_field"):
        _prepare(path, tmp_path)
    with pytest.raises(DataError, match=r"column 'n' holds int64, not text"):
        _prepare(path, tmp_path, text_field="n")
    data = _prepare(path, tmp_path, text_field="content")
    assert data.num_train_docs + data.num_val_docs == 200
    lines = tmp_path / "c.jsonl.gz"
    lines.write_bytes(gzip.compress("".join(json.dumps({"content": t}) + "\n" for t in rows[:200]).encode()))
    with pytest.raises(DataError, match=r"200 of 200 lines are not JSON objects with a string 'text' field \(set "
                                        r"data.text_field"):
        _prepare(lines, tmp_path)
    with pytest.raises(ConfigError, match="text_field: is empty"):
        DataConfig(text_field="")


def test_truncated_compressed_files_are_errors(formats, tmp_path):
    for name in ("jsonl.zst", "json.gz"):
        cut = tmp_path / formats[name].name
        cut.write_bytes(formats[name].read_bytes()[:5000])
        with pytest.raises(DataError, match=rf"{cut.name}' is truncated or corrupt"):
            _prepare(cut, tmp_path)
    cut = tmp_path / "rows.parquet"
    cut.write_bytes(formats["parquet"].read_bytes()[:-100])
    with pytest.raises(DataError, match=r"rows\.parquet' is truncated or corrupt"):
        _prepare(cut, tmp_path)


def test_json_that_is_not_json_lines_stays_a_text_document(tmp_path):
    """A package.json in a source tree is a document, as before; a .json whose first line is a record is JSON
    lines."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "package.json").write_text('{\n  "name": "x",\n  "text": "y"\n}\n')
    (tmp_path / "src" / "records.json").write_text('{"text": "one"}\n{"text": "two"}\n')
    from moetrain.data import discover_files, read_documents

    docs, _ = read_documents(discover_files(str(tmp_path / "src")))
    assert [d.name for d in docs] == ["package.json", "records:1", "records:2"]


def test_tokenizer_larger_than_the_model_vocabulary(formats, tokenizer_json, tmp_path):
    cfg = DataConfig(path=str(formats["parquet"]), seq_len=64, cache_dir=str(tmp_path / "cache"),
                     tokenizer=str(tokenizer_json))
    with pytest.raises(ConfigError, match=r"model.vocab_size: tokenizer .* has \d+ tokens, more than vocab_size 300"):
        prepare_data(cfg, 300, log=quiet)
    with pytest.raises(DataError, match="data.tokenizer: .* does not exist"):
        prepare_data(DataConfig(path=str(formats["parquet"]), tokenizer=str(tmp_path / "nope.json")), VOCAB, log=quiet)


def _train(tmp_path: Path, path: Path, *extra: str) -> str:
    from moetrain.cli import main

    run = tmp_path / f"run-{path.name}"
    assert main(["train", "--preset", "tiny", "--data", str(path), "--out", str(run), "--no-progress",
                 "--steps", "2", "train.eval_every=0", "train.ckpt_every=0", "train.log_every=1",
                 "train.eval_batches=1", "data.val_fraction=0.05", f"data.cache_dir={tmp_path / 'cache'}",
                 "train.threads=1", *extra]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2]
    assert all(np.isfinite(r["train_loss"]) for r in records if "train_loss" in r)
    return (run / "tokenizer.json").read_text()


def test_tiny_run_trains_on_each_format(formats, tokenizer_json, rows, tmp_path, capsys):
    for path in formats.values():
        _train(tmp_path, path)
    ids = _ids(tokenizer_json, rows)
    flat = tmp_path / "flat" / "rows.bin"
    flat.parent.mkdir()
    np.concatenate([np.array(d + [0], dtype=np.uint16) for d in ids]).tofile(flat)
    saved = _train(tmp_path, flat, f"data.tokenizer={tokenizer_json}", "data.token_dtype=uint16")
    assert json.loads(saved) == json.loads(tokenizer_json.read_text())  # the run keeps the tokenizer it was given


def test_small_validation_split_is_warned(tmp_path, capsys):
    """A one-file corpus at the default data.val_fraction holds out ~1% of its text: say so, with the size."""
    from moetrain.cli import main

    corpus = tmp_path / "one.txt"
    rng = random.Random(1)
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(1500)))
    assert main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(tmp_path / "run"),
                 "--no-progress", "--steps", "1", "train.eval_every=0", "train.ckpt_every=0",
                 f"data.cache_dir={tmp_path / 'cache'}", "train.threads=1"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "validation split is small" in ln)
    assert "raise data.val_fraction or add documents" in line
    val_tokens = int(line.split("small: ")[1].split(" tokens")[0].replace(",", ""))
    assert 0 < val_tokens < 2 * 64 * 8  # less than the tiny preset's 2 eval batches of 8 x 64


def test_split_by_16_byte_digests_equals_the_full_sha256_order():
    """The streaming split keeps 16 bytes of each name's SHA-256: the same held-out set as sorting by the whole
    digest (a plain loop)."""
    import hashlib

    from moetrain.data.corpus import digest_rows, held_out, name_digest

    names = [f"dir{i % 7}/file{i}.py" for i in range(5000)] + ["dup:1", "dup:1"]
    for fraction in (0.01, 0.2, 0.5):
        n_val = min(max(1, round(len(names) * fraction)), len(names) - 1)
        by_hash = sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode()).digest())
        mask = held_out(digest_rows(b"".join(name_digest(n) for n in names)), fraction)
        assert set(np.flatnonzero(mask).tolist()) == set(by_hash[:n_val])


def test_zstd_of_several_frames_reads_whole(tmp_path):
    """`zstd -c a b > c` and pzstd write several frames: all are read."""
    from moetrain.data import discover_files, read_documents

    c = zstandard.ZstdCompressor()
    lines = [json.dumps({"text": f"doc {i}"}) + "\n" for i in range(100)]
    path = tmp_path / "multi.jsonl.zst"
    path.write_bytes(c.compress("".join(lines[:40]).encode()) + c.compress("".join(lines[40:]).encode()))
    docs, _ = read_documents(discover_files(str(path)))
    assert [d.text for d in docs] == [f"doc {i}" for i in range(100)]
    assert docs[-1].name == "multi:100"


def test_arrow_stream_and_file_and_null_texts(rows, tmp_path):
    """Arrow IPC as `datasets` writes it (stream) and as a file, read batch by batch: the same documents as parquet
    (row numbers continue across batches); a null text is a bad record, an empty one is counted empty."""
    from moetrain.data.corpus import iter_documents

    texts = rows[:40] + [None, ""]
    table = pa.table({"text": texts})
    (tmp_path / "stream").mkdir()
    (tmp_path / "file").mkdir()
    (tmp_path / "pq").mkdir()
    with pa.OSFile(str(tmp_path / "stream" / "rows.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=7):
            w.write_batch(batch)
    with pa.OSFile(str(tmp_path / "file" / "rows.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=9):
            w.write_batch(batch)
    pq.write_table(table, tmp_path / "pq" / "rows.parquet", row_group_size=11)
    for kind in ("stream", "file", "pq"):
        counts = ReadStats()
        docs = list(iter_documents([next((tmp_path / kind).iterdir())], counts=counts))
        assert [(d.name, d.text) for d in docs] == [(f"rows:{i + 1}", t) for i, t in enumerate(rows[:40])], kind
        assert (counts.bad_lines, counts.empty) == (1, 1), kind
