"""Document-masked attention of packed sequences (data.packing=documents): a packed row of documents gives each
document exactly the logits and gradients of that document run alone."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import build_config
from moetrain.model.attention import document_causal_mask, document_positions
from moetrain.model.transformer import MoETransformer


def _model(seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(build_config("tiny").model)  # 2 blocks, both MoE, 4 experts top-2, dropless
    return model.train()


def test_positions_and_mask_by_hand():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    mask = document_causal_mask(ids)[0, 0]
    assert mask.shape == (8, 8)
    assert mask[2].tolist() == [True, True, True, False, False, False, False, False]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[5].tolist() == [False] * 5 + [True, False, False]
    assert mask[7].tolist() == [False] * 6 + [True, True]  # padding sees only padding


def _alone_and_packed(pad: int, dtype: torch.dtype):
    """3 documents (lengths 7, 12, 5) run alone and packed in one row (plus ``pad`` padding positions) through the
    same model in ``dtype``, each followed by a backward of the same loss (a fixed random projection of the logits
    of the real tokens). Returns (logits alone, packed pieces, grads alone, packed model)."""
    lengths = [7, 12, 5]
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 512, (n,), generator=g) for n in lengths]
    vocab = 512
    proj = [torch.randn(n, vocab, generator=g).to(dtype) for n in lengths]

    alone = _model().to(dtype)
    logits_alone = []
    for doc, r in zip(docs, proj):
        out = alone(doc[None])
        logits_alone.append(out.logits[0].detach())
        (out.logits[0] * r).sum().backward()
    grads_alone = {n: p.grad.clone() for n, p in alone.named_parameters() if p.grad is not None}

    packed_model = _model().to(dtype)
    ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])[None]  # [1, 24 + pad]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])[None]
    padding_mask = doc_ids >= 0
    out = packed_model(ids, padding_mask=padding_mask, document_ids=doc_ids)
    pieces = out.logits[0, :sum(lengths)].split(lengths)
    sum((piece * r).sum() for piece, r in zip(pieces, proj)).backward()
    return logits_alone, [p.detach() for p in pieces], grads_alone, packed_model


@pytest.mark.parametrize("pad", [0, 5])
def test_packed_documents_equal_documents_alone_forward_and_backward(pad):
    """fp32: logits within 1e-5, and the gradients of every parameter within 1e-5 relative to the gradient's
    largest entry (fp32 sums of ~10^2-sized terms round at ~4e-7 relative; measured worst case 3.4e-5 absolute on
    a gradient of max 79)."""
    logits_alone, pieces, grads_alone, packed_model = _alone_and_packed(pad, torch.float32)
    for got, want in zip(pieces, logits_alone):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for name, p in packed_model.named_parameters():
        if name in grads_alone:
            want = grads_alone[name]
            err = float((p.grad - want).abs().max())
            assert err <= 1e-5 * max(1.0, float(want.abs().max())), (name, err)
        else:
            assert p.grad is None or not p.grad.any(), name


@pytest.mark.parametrize("pad", [0, 5])
def test_packed_documents_equal_documents_alone_in_fp64_absolute(pad):
    """The same in fp64 with one absolute tolerance for every logit and every gradient entry, however large the
    gradient: 1e-10 (measured worst: 2.2e-16 on the logits, 2.6e-14 on a gradient of max 79; a leak across
    documents or into padding is > 1e-3, see the test below). Every parameter that gets a gradient alone gets the same one packed, and no other."""
    logits_alone, pieces, grads_alone, packed_model = _alone_and_packed(pad, torch.float64)
    assert all(p.dtype == torch.float64 for p in pieces)
    for got, want in zip(pieces, logits_alone):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    got = {n: p.grad for n, p in packed_model.named_parameters() if p.grad is not None and p.grad.any()}
    assert sorted(got) == sorted(n for n, g in grads_alone.items() if g.any())
    worst = max(float((got[n] - grads_alone[n]).abs().max()) for n in got)
    assert worst <= 1e-10, worst


def test_packing_changes_logits_without_document_ids():
    """The reference the test above relies on is sensitive: without the mask, a later document sees the earlier
    ones and its logits differ."""
    model = _model()
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, 512, (6,), generator=g), torch.randint(1, 512, (6,), generator=g)
    with torch.no_grad():
        plain = model(torch.cat([a, b])[None]).logits[0, 6:]
        alone = model(b[None]).logits[0]
    assert (plain - alone).abs().max() > 1e-3


def test_document_ids_with_kv_cache_refused():
    from moetrain.model.attention import KVCache

    attn = _model().blocks[0].attn
    with pytest.raises(ValueError, match="document_ids"):
        attn(torch.ones(1, 3, 64), kv_cache=KVCache(2, 1, 3), document_ids=torch.zeros(1, 3, dtype=torch.long))
