"""Token-budget micro-batches (train.tokens_per_batch): accumulation over micro-batches of different token counts
equals one large batch of the same tokens (fp64, 1e-6), aux losses included; length bucketing keeps padding under
5% on a length-skewed corpus."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrain.config import build_config
from moetrain.data.batch import PackedBatch
from moetrain.data.packing import DocumentBatches, DocumentChunks, budget_batches
from moetrain.model.transformer import MoETransformer
from moetrain.train.step import accumulate_gradients

NO_MOE_LOSS = dict(aux_loss_coeff=0.0, pooled_aux_loss_coeff=0.0, seq_aux_loss_coeff=0.0, global_aux_loss_coeff=0.0,
                   z_loss_coeff=0.0, util_loss_coeff=0.0)
# Every term that is linear in the batch: the LM loss, z-loss (token means), the sequence-level aux loss (a mean
# over sequences) and the global-batch aux loss (the step's counts). The Switch / pooled / utilisation losses are
# non-linear in the batch (their one-large-batch form is the global-batch aux loss) and stay off here.
LINEAR_TERMS = dict(z_loss_coeff=0.1, seq_aux_loss_coeff=0.5, global_aux_loss_coeff=0.5)


def _model(**losses) -> MoETransformer:
    cfg = build_config("tiny", overrides={"model": {"moe": {"losses": {**NO_MOE_LOSS, **losses}}}}).model
    torch.manual_seed(0)
    model = MoETransformer(cfg).double()
    with torch.no_grad():  # a router with real preferences, so the balancing losses have sizeable gradients
        for layer in model.moe_layers():
            layer.router.weight.normal_(0, 0.5)
    return model.train()


def _docs(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n + 1,), generator=g) for n in lengths]  # n (input, target) pairs each


def _packed(docs, width=None) -> PackedBatch:
    """One document per row, right-padded to ``width`` (default: the longest)."""
    s = width or max(len(d) - 1 for d in docs)
    inputs = torch.zeros(len(docs), s, dtype=torch.long)
    targets = torch.full((len(docs), s), -100, dtype=torch.long)
    for r, d in enumerate(docs):
        inputs[r, : len(d) - 1], targets[r, : len(d) - 1] = d[:-1], d[1:]
    return PackedBatch(inputs, targets, targets != -100)


def _grads(model, batches):
    model.zero_grad(set_to_none=True)
    acc = accumulate_gradients(model, batches, "fp32", torch.device("cpu"))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, acc


@pytest.mark.parametrize("terms", [{}, LINEAR_TERMS], ids=["lm", "lm+z+seq+global"])
def test_uneven_micro_batches_equal_one_large_batch(terms):
    lengths = [5, 6, 6, 7, 11, 12, 30]
    docs = _docs(lengths)
    micro = [_packed(docs[:4]), _packed(docs[4:6]), _packed(docs[6:])]  # [4, 7], [2, 12], [1, 30]
    assert len({b.real_tokens for b in micro}) == 3  # 24, 23, 30 real tokens: the weighting matters
    big = _packed(docs, width=32)  # the same tokens as one batch, more padding
    model = _model(**terms)
    want, acc_big = _grads(model, [big])
    got, acc = _grads(model, micro)
    assert want.keys() == got.keys() and any("router" in n for n in want)
    for name in want:
        scale = max(want[name].abs().max().item(), 1e-3)
        assert (want[name] - got[name]).abs().max().item() <= 1e-6 * scale, name
    # the step accumulates the reported losses in fp32 (its zero tensors), so compare them at fp32 precision
    assert abs(acc.lm_loss.item() - acc_big.lm_loss.item()) <= 1e-6 * abs(acc_big.lm_loss.item())
    for name in ("z_loss", "seq_aux_loss", "global_aux_loss", "moe_loss") if terms else ():
        want_loss = acc_big.moe_losses[name].item()
        assert abs(acc.moe_losses[name].item() - want_loss) <= 1e-6 * abs(want_loss), name


def test_unweighted_average_would_differ():
    """The reference is sensitive: averaging the micro-batch losses 1/g (the fixed-shape rule) misses it."""
    docs = _docs([5, 6, 6, 7, 11, 12, 30])
    micro = [_packed(docs[:4]), _packed(docs[4:6]), _packed(docs[6:])]
    model = _model()
    want, _ = _grads(model, [_packed(docs)])
    model.zero_grad(set_to_none=True)
    for b in micro:
        (model(b.inputs, b.targets, padding_mask=b.padding_mask).loss / 3).backward()
    name = "embed_tokens.weight"
    assert (want[name] - model.embed_tokens.weight.grad).abs().max().item() > 1e-4


def _padding(batch) -> float:
    return 1 - batch.real_tokens / batch.padding_mask.numel()


def test_padding_under_5_percent_on_skewed_lengths():
    """Documents of 20..2,000 tokens (log-uniform: most short, a long tail), S=1024, a 4096-token budget: under 5%
    padding in every micro-batch (not only overall), every chunk once, every micro-batch within the budget."""
    rng = np.random.default_rng(0)
    n_docs = 3000
    doc_lens = np.exp(rng.uniform(np.log(20), np.log(2000), n_docs)).astype(np.int64)
    stream = np.concatenate([np.concatenate([rng.integers(1, 500, n), [0]]) for n in doc_lens]).astype(np.uint16)
    chunks = DocumentChunks(stream, 0, 1024)
    ds = DocumentBatches(chunks, batch_size=1, tokens_per_batch=4096, seed=0)
    batches = [ds[(0, i)] for i in range(ds.num_batches(0))]
    plan = ds._plan(0)
    assert sorted(c for rows in plan for row in rows for c in row) == list(range(len(chunks)))  # every chunk once
    real = sum(b.real_tokens for b in batches)
    positions = sum(b.padding_mask.numel() for b in batches)
    assert real == int(chunks.length.sum())
    assert all(b.padding_mask.numel() <= 4096 and b.inputs.shape[1] <= 1024 for b in batches)
    assert max(_padding(b) for b in batches) < 0.05, sorted(_padding(b) for b in batches)[-5:]
    assert 1 - real / positions < 0.01
    # rows of one long chunk need no document mask; short chunks share rows (document-masked)
    assert any(b.document_ids is None for b in batches) and any(b.document_ids is not None for b in batches)
    # without bucketing (each micro-batch from the random order, one chunk per row) the same budget pads far more
    positions, rows, longest = 0, 0, 0
    for n in chunks.length[np.random.default_rng(1).permutation(len(chunks))].tolist():
        if (rows + 1) * max(longest, n) > 4096:
            positions, rows, longest = positions + rows * longest, 0, 0
        rows, longest = rows + 1, max(longest, n)
    positions += rows * longest
    assert 1 - real / positions > 0.3
    # and pools of one budget sort too few chunks: some micro-batches pad far more
    one = budget_batches(chunks.length, np.arange(len(chunks)), 4096, 1024, np.random.default_rng(0), pool_budgets=1)
    assert max(1 - sum(int(chunks.length[r].sum()) for r in b) / (len(b) * max(int(chunks.length[r].sum()) for r in b))
               for b in one) > 0.1


def _skewed_jsonl(path, n_docs=300, seed=0) -> list[int]:
    """A ``.jsonl`` of ``n_docs`` documents whose lengths are log-uniform in 20..2,000 words (most short, a long
    tail) over a 20-word vocabulary, so that the run's BPE makes every word (with its space) one token: a document
    of n words is n tokens (checked after the run with the run's own tokenizer). Returns the word counts."""
    import json

    rng = np.random.default_rng(seed)
    words = ["the", "of", "and", "to", "in", "is", "was", "it", "for", "on", "as", "with", "by", "at", "from", "or",
             "an", "be", "this", "which"]
    lengths = np.exp(rng.uniform(np.log(20), np.log(2000), n_docs)).astype(np.int64).tolist()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n" for n in lengths))
    return lengths


def test_padding_under_5_percent_in_a_real_run_on_a_skewed_jsonl(tmp_path):
    """The real pipeline (moetrain train on a .jsonl, data.packing=documents, train.tokens_per_batch): every
    padding_fraction logged (every step, one micro-batch each) is under 5%; so is every micro-batch of the epoch."""
    import json

    from tokenizers import Tokenizer

    from moetrain.cli import main
    from moetrain.config import Config
    from moetrain.data.dataset import prepare_data
    from moetrain.data.loader import build_pipeline

    corpus = tmp_path / "docs.jsonl"
    lengths = _skewed_jsonl(corpus)
    run = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--preset", "tiny", "--data", str(corpus), "--out", str(run), "--no-progress",
                     "--steps", "10", "data.packing=documents", "data.seq_len=1024", "model.max_seq_len=1024",
                     "train.tokens_per_batch=4096", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
                     "train.ckpt_every=0", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.05",
                     "train.threads=1"]) == 0
    finally:
        torch.set_num_threads(threads)
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert [len(tok.encode(d).ids) for d in docs] == lengths  # the corpus is as skewed as claimed
    assert min(lengths) <= 25 and max(lengths) >= 1500 and np.median(lengths) < 400
    logged = [r["padding_fraction"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "padding_fraction" in r]
    assert len(logged) == 10
    assert max(logged) < 0.05, logged
    # every micro-batch of the epoch, not only the 10 the run drew
    cfg = Config.from_dict(json.loads((run / "config.json").read_text()))
    data = prepare_data(cfg.data, cfg.model.vocab_size, tokenizer_path=run / "tokenizer.json", log=lambda _: None)
    train = build_pipeline(data, 1024, "documents", cfg.train.batch_size, 4096, 1, cfg.train.seed).train
    plan = [train.dataset[(0, i)] for i in range(train.dataset.num_batches(0))]
    padding = [_padding(b) for b in plan]
    assert max(padding) < 0.05, sorted(padding)[-5:]
