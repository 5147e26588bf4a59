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


def test_padding_under_5_percent_on_skewed_lengths():
    """Documents of 20..2,000 tokens (log-uniform: most short, a long tail), S=1024, a 4096-token budget."""
    rng = np.random.default_rng(0)
    n_docs = 3000
    doc_lens = np.exp(rng.uniform(np.log(20), np.log(2000), n_docs)).astype(np.int64)
    stream = np.concatenate([np.concatenate([rng.integers(1, 500, n), [0]]) for n in doc_lens]).astype(np.uint16)
    chunks = DocumentChunks(stream, 0, 1024)
    ds = DocumentBatches(chunks, batch_size=1, tokens_per_batch=4096, seed=0)
    batches = [ds[(0, i)] for i in range(ds.num_batches(0))]
    real = sum(b.real_tokens for b in batches)
    positions = sum(b.padding_mask.numel() for b in batches)
    assert real == int(chunks.length.sum())  # every chunk once
    assert all(b.padding_mask.numel() <= 4096 for b in batches)
    assert 1 - real / positions < 0.05, 1 - real / positions
    # without bucketing (each micro-batch from the random order) the same budget pads far more
    positions, rows, longest = 0, 0, 0
    for n in chunks.length[np.random.default_rng(1).permutation(len(chunks))].tolist():
        if (rows + 1) * max(longest, n) > 4096:
            positions, rows, longest = positions + rows * longest, 0, 0
        rows, longest = rows + 1, max(longest, n)
    positions += rows * longest
    assert 1 - real / positions > 0.3
    # and a pool of one budget sorts too few chunks
    one = budget_batches(chunks.length, np.arange(len(chunks)), 4096, np.random.default_rng(0), pool_budgets=1)
    assert 1 - real / sum(len(b) * int(chunks.length[b].max()) for b in one) > 0.05
