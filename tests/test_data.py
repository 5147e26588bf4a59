"""Tests of the data pipeline: discovery, reading, splitting, tokenizer, cache, windows and sampling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.data import (
    BatchSampler,
    DataConfig,
    Document,
    TokenWindows,
    default_corpus_files,
    discover_files,
    eval_batches,
    load_tokenizer,
    prepare_data,
    read_documents,
    split_documents,
    train_tokenizer,
)
from moetrain.data import prepare as prepare_module
from moetrain.errors import ConfigError, DataError

from conftest import SHAKESPEARE  # noqa: E402 -- one path for every test that needs it

CODE = '''def greet(name: str) -> str:
    """Say hello — with unicode: héllo, 世界, emoji 🚀."""
\treturn f"hello {name}!"   # trailing spaces   

class Point:
    x: float = 0.0
    y: float = 0.0
'''


def make_corpus(root: Path, n_files: int = 12) -> Path:
    """A small directory corpus of ``n_files`` Python-like files in two subdirectories."""
    for i in range(n_files):
        sub = root / f"pkg{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i:02d}.py").write_text(CODE.replace("greet", f"greet{i}") * (3 + i % 4))
    return root


def quiet(_msg: str) -> None:
    pass


# ---- discovery -----------------------------------------------------------------------------------------------

def test_default_corpus_is_sorted_stdlib_without_site_packages():
    files = default_corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert files, "the default corpus is empty"
    rel = [f.relative_to(stdlib).as_posix() for f in files]
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    assert not any(part in ("site-packages", "dist-packages") for r in rel for part in r.split("/"))


def test_discover_directory_glob_and_file(tmp_path):
    root = make_corpus(tmp_path / "corpus", n_files=4)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    files = discover_files(str(root))
    assert [f.relative_to(root).as_posix() for f in files] == [
        "pkg0/mod00.py", "pkg0/mod02.py", "pkg1/mod01.py", "pkg1/mod03.py"]
    assert discover_files(str(root / "**" / "*.py")) == sorted(files)
    assert discover_files(str(root / "pkg1" / "*.py")) == [root / "pkg1/mod01.py", root / "pkg1/mod03.py"]
    assert discover_files(str(files[0])) == [files[0]]


def test_discover_missing_path_and_empty_glob(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        discover_files(str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="does not exist"):
        discover_files(str(tmp_path / "*.nothing"))


def test_discover_names_what_a_path_that_exists_is_instead(tmp_path):
    os.mkfifo(tmp_path / "pipe")  # opening it for reading would block until a writer comes
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(DataError, match="pipe' is not a regular file or directory"):
        discover_files(str(tmp_path / "pipe"))
    for name in ("loop", "dangling"):
        with pytest.raises(DataError, match=f"{name}' is a broken symbolic link"):
            discover_files(str(tmp_path / name))


# ---- reading -------------------------------------------------------------------------------------------------

def test_read_jsonl_counts_bad_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": "first doc"}), "not json", json.dumps({"content": "x"}), "",
             json.dumps({"text": "second doc", "id": 2}), json.dumps({"text": ""})]
    path.write_text("\n".join(lines) + "\n")
    docs, stats = read_documents(discover_files(str(path)))
    assert [d.text for d in docs] == ["first doc", "second doc"]
    assert [d.name for d in docs] == ["docs:1", "docs:5"]  # record names drop the format suffix
    assert (stats.bad_lines, stats.empty, stats.skipped) == (2, 1, 3)


def test_read_jsonl_splits_lines_only_at_newlines(tmp_path):
    # JSON leaves U+2028, U+2029 and U+0085 unescaped (ensure_ascii=False); str.splitlines() would cut there.
    path = tmp_path / "docs.jsonl"
    texts = ["a\u2028b", "c\u2029d\x85e", "f\r\ng"]
    path.write_text("\r\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts) + "\r\n")
    docs, stats = read_documents([path])
    assert [d.text for d in docs] == texts and stats.skipped == 0
    assert [d.name for d in docs] == ["docs:1", "docs:2", "docs:3"]


def test_read_jsonl_without_text_field_is_an_error(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match="docs.jsonl.*'text'"):
        read_documents([path])


def test_binary_and_empty_files_are_skipped_and_counted(tmp_path):
    root = make_corpus(tmp_path / "c", n_files=3)
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not valid UTF-8
    (root / "empty.txt").write_text("")
    docs, stats = read_documents(discover_files(str(root)))
    assert len(docs) == 3
    assert (stats.files, stats.binary, stats.empty, stats.skipped) == (6, 2, 1, 3)
    assert "2 binary" in stats.describe()


def test_corpus_without_usable_text_is_an_error(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\0\1\2")
    (tmp_path / "b.bin").write_bytes(b"\0\3\4")
    (tmp_path / "c.txt").write_text("")
    with pytest.raises(DataError, match=r"no usable text in .*3 skipped \(2 binary, 1 empty\)"):
        read_documents(discover_files(str(tmp_path)))


# ---- splitting -----------------------------------------------------------------------------------------------

def test_split_by_file_is_deterministic_and_disjoint():
    docs = [Document(f"dir/file{i}.py", f"text {i}\n") for i in range(50)]
    train, val = split_documents(docs, 0.1)
    assert len(val) == 5 and len(train) == 45
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert split_documents(list(reversed(docs)), 0.1)[1] == list(reversed(val))  # order-independent choice
    assert split_documents(docs, 0.1) == (train, val)
    # At least one validation document, however small the fraction; never all of them.
    assert [len(s) for s in split_documents(docs[:2], 0.001)] == [1, 1]
    assert [len(s) for s in split_documents(docs[:2], 0.999)] == [1, 1]


def test_single_document_is_split_by_text_at_a_newline():
    text = "".join(f"line {i}\n" for i in range(100))
    (train,), (val,) = split_documents([Document("one.txt", text)], 0.1)
    assert train.text + val.text == text
    assert train.text.endswith("\n")
    assert abs(len(val.text) - 0.1 * len(text)) < 0.02 * len(text)


# ---- tokenizer -----------------------------------------------------------------------------------------------

def test_tokenizer_round_trips_and_is_deterministic():
    texts = [CODE, "x = 1\n\n\n    y = 2\r\n", "naïve café ü\tß — «quotes»\n"]
    tok = train_tokenizer(texts * 5, vocab_size=400)
    assert tok.token_to_id("<|endoftext|>") == 0
    assert 257 <= tok.get_vocab_size() <= 400
    for s in texts + [" leading space", "unseen: Ω≈ç√∫ 日本語 \u00a0 \x00 end  "]:
        assert tok.decode(tok.encode(s).ids) == s
    assert train_tokenizer(texts * 5, vocab_size=400).to_str() == tok.to_str()


def test_tokenizer_is_deterministic_across_processes():
    # Rust HashMaps are seeded per process; a tie broken by hash order would show up only here.
    script = ("import sys; from moetrain.data.tokenizer import train_tokenizer; "
              "sys.stdout.write(train_tokenizer([open(sys.argv[1]).read()], 300).to_str())")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(CODE * 3)
        f.flush()
        out = subprocess.run([sys.executable, "-c", script, f.name], capture_output=True, text=True, env=env,
                             check=True).stdout
        assert out == train_tokenizer([CODE * 3], 300).to_str()


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.vocab_size"):
        train_tokenizer(["abc"], vocab_size=256)
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path / "missing.json")


# ---- prepare_data and the cache ------------------------------------------------------------------------------

def test_prepare_data_caches_tokenizer_and_tokens(tmp_path, monkeypatch):
    root = make_corpus(tmp_path / "corpus")
    cfg = DataConfig(path=str(root), seq_len=16, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    first = prepare_data(cfg, vocab_size=300, log=quiet)
    assert first.train_tokens.dtype == np.uint16 and first.train_tokens.ndim == 1
    assert (first.num_train_docs, first.num_val_docs, first.skipped, first.eos_id) == (10, 2, 0, 0)
    assert int(np.sum(first.train_tokens == 0)) == first.num_train_docs  # one EOS after each document
    assert first.train_tokens[-1] == 0 and first.val_tokens[-1] == 0
    assert list(first.cache_path.parent.glob("**/*.tmp")) == []

    def no_training(*args, **kwargs):
        raise AssertionError("tokenizer retrained despite a cache hit")

    monkeypatch.setattr(prepare_module, "train_tokenizer", no_training)
    logs: list[str] = []
    second = prepare_data(cfg, vocab_size=300, log=logs.append)
    assert any("reused" in line for line in logs)
    assert second.tokenizer.to_str() == first.tokenizer.to_str()
    np.testing.assert_array_equal(second.train_tokens, first.train_tokens)
    np.testing.assert_array_equal(second.val_tokens, first.val_tokens)

    # A resumed run passes the tokenizer it saved (pretty-printed by Tokenizer.save): the same entry is reused.
    first.tokenizer.save(str(tmp_path / "run_tokenizer.json"))
    logs.clear()
    resumed = prepare_data(cfg, vocab_size=300, tokenizer_path=tmp_path / "run_tokenizer.json", log=logs.append)
    assert any("reused" in line for line in logs)
    np.testing.assert_array_equal(resumed.train_tokens, first.train_tokens)

    # A different tokenizer is a different entry: tokenized anew with it, never trained.
    other = tmp_path / "other_tokenizer.json"
    train_tokenizer([CODE], vocab_size=280).save(str(other))
    logs.clear()
    with_other = prepare_data(cfg, vocab_size=300, tokenizer_path=other, log=logs.append)
    assert not any("reused" in line for line in logs)
    assert with_other.tokenizer.get_vocab_size() <= 280
    assert with_other.tokenizer.decode(with_other.val_tokens[:-1].tolist()).startswith(
        first.tokenizer.decode(first.val_tokens[:20].tolist()))


def test_file_name_that_is_not_utf8_is_read_and_cached(tmp_path):
    root = make_corpus(tmp_path / "corpus", n_files=4)
    (root / os.fsdecode(b"caf\xe9.txt")).write_text(CODE)  # a Latin-1 file name: not valid UTF-8
    docs, _ = read_documents(discover_files(str(root)))
    assert "caf\\xe9.txt" in [d.name for d in docs]  # printable, and the same on every machine
    cfg = DataConfig(path=str(root), seq_len=8, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, vocab_size=300, log=quiet)
    assert data.num_train_docs + data.num_val_docs == 5


def test_edit_that_keeps_size_and_mtime_is_not_served_from_the_cache(tmp_path):
    # `cp -p`, `rsync -t`, `touch -r` or an archive restore keep a file's mtime; an edit of the same length then
    # looks unchanged by size and mtime alone.
    root = make_corpus(tmp_path / "corpus", n_files=4)
    cfg = DataConfig(path=str(root), seq_len=8, val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    prepare_data(cfg, vocab_size=300, log=quiet)
    target = root / "pkg0" / "mod00.py"
    st = target.stat()
    target.write_text(target.read_text().replace("greet", "adieu"))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target.stat().st_size == st.st_size
    logs: list[str] = []
    again = prepare_data(cfg, vocab_size=300, log=logs.append)
    assert not any("reused" in line for line in logs)
    assert "adieu" in again.tokenizer.decode(np.concatenate([again.train_tokens, again.val_tokens]).tolist())


def test_interrupted_cache_entry_is_rebuilt(tmp_path):
    root = make_corpus(tmp_path / "corpus", n_files=4)
    cfg = DataConfig(path=str(root), seq_len=8, val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    first = prepare_data(cfg, vocab_size=300, log=quiet)
    expected, entry = np.array(first.train_tokens), first.cache_path
    del first  # drop the memmap before truncating its file
    (entry / "train.bin").write_bytes(b"\1\0")  # as if truncated: meta.json no longer matches
    logs: list[str] = []
    again = prepare_data(cfg, vocab_size=300, log=logs.append)
    assert not any("reused" in line for line in logs)
    np.testing.assert_array_equal(again.train_tokens, expected)


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "empty.txt").write_text("")
    cfg = DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="no usable text"):
        prepare_data(cfg, vocab_size=300, log=quiet)


def test_corpus_shorter_than_one_sequence_is_an_error(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words\nand another line\n")
    cfg = DataConfig(path=str(path), seq_len=256, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"shorter than one sequence of data.seq_len=256.*lower data.seq_len"):
        prepare_data(cfg, vocab_size=300, log=quiet)


def test_two_token_corpus_is_refused_before_it_is_split_or_cached(tmp_path):
    # "ab" is 2 tokens: too short for a training and a validation sequence of data.seq_len=2 tokens (3 each with
    # the EOS). It is refused before its one document is cut into a training and a validation part, and before
    # anything is written to the cache.
    path = tmp_path / "tiny.txt"
    path.write_text("ab")
    cache = tmp_path / "cache"
    logs: list[str] = []
    cfg = DataConfig(path=str(path), seq_len=2, cache_dir=str(cache))
    with pytest.raises(DataError, match=r"shorter than one sequence of data.seq_len=2.*at most 2 training tokens"):
        prepare_data(cfg, vocab_size=300, log=logs.append)
    assert not any("split" in line or "tokenized" in line for line in logs)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_split_found_short_after_tokenizing_leaves_no_cache_entry(tmp_path):
    # BPE merges make the validation split shorter in tokens than in bytes: the refusal comes after tokenizing,
    # and the tokens written meanwhile are removed, not left as a cache entry.
    root = make_corpus(tmp_path / "corpus", n_files=4)
    cache = tmp_path / "cache"
    probe = prepare_data(DataConfig(path=str(root), seq_len=8, val_fraction=0.25, cache_dir=str(tmp_path / "probe")),
                         vocab_size=300, log=quiet)
    val_bytes = len(probe.tokenizer.decode(probe.val_tokens.tolist()).encode())
    assert len(probe.val_tokens) < val_bytes  # merges: fewer tokens than bytes
    cfg = DataConfig(path=str(root), seq_len=len(probe.val_tokens), val_fraction=0.25, cache_dir=str(cache))
    with pytest.raises(DataError, match=rf"validation split .* \({len(probe.val_tokens)} tokens, need"):
        prepare_data(cfg, vocab_size=300, log=quiet)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_tinyshakespeare_single_file(tmp_path):
    cfg = DataConfig(path=str(SHAKESPEARE), seq_len=64, val_fraction=0.1, tokenizer_max_bytes=200_000,
                     cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, vocab_size=300, log=quiet)
    assert (data.num_train_docs, data.num_val_docs) == (1, 1)
    assert len(data.train_tokens) > 8 * len(data.val_tokens) > 0
    assert len(TokenWindows(data.val_tokens, 64)) > 0
    head = data.tokenizer.decode(data.train_tokens[:50].tolist())
    assert SHAKESPEARE.read_text().startswith(head)


# ---- windows, sampling, eval batches -------------------------------------------------------------------------

def test_windows_targets_are_inputs_shifted_by_one():
    tokens = np.arange(103, dtype=np.uint16)
    windows = TokenWindows(tokens, seq_len=10)
    assert len(windows) == 10  # (103 - 1) // 10
    inputs, targets = windows.get([0, 3, 9])
    assert inputs.shape == targets.shape == (3, 10)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(inputs[1], torch.arange(30, 40)) and torch.equal(targets[1], torch.arange(31, 41))
    assert targets[2, -1] == 100
    with pytest.raises(IndexError):
        windows.get([10])


def test_sampler_is_deterministic_and_resumable():
    windows = TokenWindows(np.arange(10 * 4 + 1, dtype=np.uint16), seq_len=4)  # 10 windows
    a = BatchSampler(windows, batch_size=3, seed=7)
    batches = []
    for step in range(7):
        if step == 3:
            state = a.state_dict()
        batches.append(a.next_batch())
    assert state == {"position": 9, "seed": 7}

    b = BatchSampler(windows, batch_size=3, seed=123)
    b.load_state_dict(state)
    for expected in batches[3:]:
        got = b.next_batch()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    # Without replacement: every epoch (10 windows) is a permutation, even across batch boundaries.
    starts = torch.cat([x[:, 0] for x, _ in batches])[:20] // 4
    assert sorted(starts[:10].tolist()) == list(range(10)) and sorted(starts[10:].tolist()) == list(range(10))
    assert starts[:10].tolist() != starts[10:].tolist()  # a new permutation each epoch


def test_eval_batches_are_fixed_and_at_least_one():
    windows = TokenWindows(np.arange(41, dtype=np.uint16), seq_len=4)  # 10 windows
    batches = eval_batches(windows, batch_size=3, n_batches=5)
    assert len(batches) == 3 and all(x.shape == (3, 4) for x, _ in batches)
    assert torch.equal(batches[0][0][0], torch.arange(4))
    small = eval_batches(windows, batch_size=16, n_batches=2)
    assert len(small) == 1 and small[0][0].shape == (10, 4)


def test_abandoned_cache_stages_are_removed_live_ones_kept(tmp_path):
    """A killed preparation's staging directory (its builder, on this host, is gone) is deleted by the next build;
    a live builder's and another host's are left alone."""
    import socket
    import subprocess
    import sys

    from moetrain.data.dataset import _remove_abandoned_stages

    entry = tmp_path / "tokens-abc"
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    names = [f".tokens-abc.{host}-{dead}.x1.tmp", f".tokens-abc.{host}-{os.getpid()}.x2.tmp",
             ".tokens-abc.other-host-1.x3.tmp", f".tokens-abcd.{host}-{dead}.x4.tmp"]
    stages = {name: tmp_path / name for name in names}
    for path in stages.values():
        path.mkdir()
        (path / "train.bin").write_bytes(b"\0" * 8)
    _remove_abandoned_stages(entry)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(list(stages)[1:])
