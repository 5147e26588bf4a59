"""Issue 9: the fast paths equal their references.

- ``fused`` experts (moe/fast_moe.py ``fused_experts``, tiles and grouped modes) == the per-expert loop, outputs and all three
  gradients, fp32 and bf16, SwiGLU and GELU, with idle experts, rows past the last group and several tiles per
  expert; and fp64 ``gradcheck`` against finite differences.
- dropless permute / combine (moe/dispatch.py) == plain autograd indexing.
- the fused dropless layer FFN (moe/fast_moe.py, tiles and grouped modes) == LocalDispatcher + loop experts +
  combine, output and the gradients of x, the gating weights and both expert weights; fp64 ``gradcheck``.
- the MoE layer with the ``fused`` backend == the ``loop`` backend.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.execution import ExecutionConfig
from moetrain.moe.config import CapacityConfig, ExpertsConfig, MoEConfig
from moetrain.moe.dispatch import LocalDispatcher, combine_rows, permute_rows
from moetrain.moe.experts import loop_experts
from moetrain.moe.fast_moe import fused_experts, fused_moe
from moetrain.moe.layer import MoELayer

# Experts 1 and 4 idle; expert 2 spans several tiles at tile_rows=4; 3 rows past the last group.
COUNTS = [5, 0, 11, 1, 0, 7]
EXTRA_ROWS = 3


def _case(activation: str, dtype: torch.dtype, d: int = 16, f: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e = len(COUNTS)
    width = 2 * f if activation == "swiglu" else f
    r = sum(COUNTS) + EXTRA_ROWS
    x = torch.randn(r, d, generator=g).to(dtype)
    w_in = (torch.randn(e, width, d, generator=g) * 0.3).to(dtype)
    w_out = (torch.randn(e, d, f, generator=g) * 0.3).to(dtype)
    up = torch.randn(r, d, generator=g).to(dtype)  # upstream gradient
    return x, w_in, w_out, up


def _run(fn, x, w_in, w_out, up, counts, activation):
    x, w_in, w_out = (t.clone().requires_grad_() for t in (x, w_in, w_out))
    y = fn(x, w_in, w_out, counts, activation)
    used = int(counts.sum())
    (y[:used].float() * up[:used].float()).sum().backward()
    return y[:used].detach(), x.grad[:used], w_in.grad, w_out.grad, x.grad[used:]


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,tile_rows", [("tiles", 4), ("tiles", 256), ("grouped", 256)])
def test_fused_experts_equal_loop(activation, dtype, mode, tile_rows):
    x, w_in, w_out, up = _case(activation, dtype)
    counts = torch.tensor(COUNTS)

    def fused(*args):
        return fused_experts(*args, mode=mode, block_rows=tile_rows)

    got = _run(fused, x, w_in, w_out, up, counts, activation)
    ref = _run(loop_experts, x, w_in, w_out, up, counts, activation)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(["y", "dx", "dw_in", "dw_out"], got[:4], ref[:4]):
        scale = b.float().abs().max().clamp(min=1.0)
        assert (a.float() - b.float()).abs().max() <= tol * scale, name
    # Idle experts: exactly zero weight gradients. Rows past the last group: zero input gradient on the tiled path
    # (unspecified on the grouped one, like grouped_mm's own; the dispatcher masks them).
    for grad in got[2:4]:
        assert grad[1].abs().max() == 0 and grad[4].abs().max() == 0
    if mode == "tiles":
        assert got[4].abs().max() == 0
    assert all(torch.isfinite(t).all() for t in got[:4])


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_fused_experts_gradcheck(activation):
    x, w_in, w_out, _ = _case(activation, torch.float64, d=6, f=5)
    counts = torch.tensor(COUNTS)
    used = int(counts.sum())
    x = x[:used].clone().requires_grad_()
    w_in, w_out = w_in.requires_grad_(), w_out.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b, c: fused_experts(a, b, c, counts, activation, mode="tiles", block_rows=4), (x, w_in, w_out))


def test_fused_experts_rejects_bad_input():
    x, w_in, w_out, _ = _case("swiglu", torch.float32)
    with pytest.raises(ValueError, match="mode"):
        fused_experts(x, w_in, w_out, torch.tensor(COUNTS), mode="fast")
    with pytest.raises(ValueError, match="shapes"):
        fused_experts(x, w_in, w_out, torch.tensor(COUNTS[:-1]))
    with pytest.raises(ValueError, match="counts sum"):
        fused_experts(x[:5], w_in, w_out, torch.tensor(COUNTS))


def test_fused_experts_under_autocast_matches_bf16_loop():
    x, w_in, w_out, up = _case("swiglu", torch.float32)
    counts = torch.tensor(COUNTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(fused_experts, x, w_in, w_out, up, counts, "swiglu")
        ref = _run(loop_experts, x, w_in, w_out, up, counts, "swiglu")
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32  # fp32 master weights keep fp32 grads
    for a, b in zip(got[:4], ref[:4]):
        assert (a.float() - b.float()).abs().max() <= 3e-2 * b.float().abs().max().clamp(min=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3])
def test_permute_and_combine_equal_autograd_indexing(dtype, k):
    g = torch.Generator().manual_seed(1)
    t, d, e = 9, 8, 5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, K] distinct experts
    order = torch.sort(ids.reshape(-1), stable=True).indices
    token_ids = order // k
    rows_of = torch.empty_like(order).scatter_(0, order, torch.arange(t * k)).view(t, k)
    x = torch.randn(t, d, generator=g).to(dtype)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    f = torch.randn(t * k, d, generator=g).to(dtype)  # stands in for the experts: rows -> rows * f
    up = torch.randn(t, d, generator=g)

    def run(fast: bool):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        if fast:
            rows = permute_rows(xs, token_ids, rows_of)
            out = combine_rows(rows * f, rows_of, ws, token_ids)
        else:
            rows = xs[token_ids]
            picked = (rows * f)[rows_of.reshape(-1)].reshape(t, k, d).float()
            out = (picked * ws[..., None]).sum(1).to(dtype)
        (out.float() * up).sum().backward()
        return out.detach().float(), xs.grad.float(), ws.grad

    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for a, b in zip(run(True), run(False)):
        assert (a - b).abs().max() <= tol * b.abs().max().clamp(min=1.0)


def _moe_case(activation: str, dtype: torch.dtype, t: int = 13, d: int = 16, f: int = 8, k: int = 2, e: int = 6):
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(e - 2, generator=g)[:k] for _ in range(t)])  # the last 2 experts idle
    w = torch.softmax(torch.randn(t, k, generator=g, dtype=torch.float64), -1)
    w = w if dtype == torch.float64 else w.float()
    x = torch.randn(t, d, generator=g, dtype=torch.float64).to(dtype)
    width = 2 * f if activation == "swiglu" else f
    w_in = (torch.randn(e, width, d, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    w_out = (torch.randn(e, d, f, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    return ids, [x, w, w_in, w_out]


def _unfused_moe(ids, activation, x, w, w_in, w_out):
    dispatcher = LocalDispatcher(w_in.shape[0])
    rows, counts, meta = dispatcher.dispatch(x, ids, w)
    return dispatcher.combine(loop_experts(rows, w_in, w_out, counts, activation), meta)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,block_rows", [("tiles", None), ("tiles", 1), ("tiles", 7), ("grouped", None)])
@pytest.mark.parametrize("recompute", [False, True])
def test_fused_moe_equals_unfused_layer_path(activation, dtype, mode, block_rows, recompute):
    ids, inputs = _moe_case(activation, dtype)
    up = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(4)).to(dtype)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        (y.float() * up.float()).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    got = run(lambda x, w, a, b: fused_moe(x, ids, w, a, b, activation, mode=mode, block_rows=block_rows,
                                           recompute=recompute))
    ref = run(lambda x, w, a, b: _unfused_moe(ids, activation, x, w, a, b))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(["y", "dx", "dw", "dw_in", "dw_out"], got, ref):
        assert a.dtype == b.dtype, name
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max().clamp(min=1.0), name
    for grad in got[3:]:  # idle experts
        assert grad[-2:].abs().max() == 0


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_one_block_as_grouped_gemms_equals_the_tile_loop_bit_for_bit(monkeypatch, activation, dtype):
    """All rows in one block (a decode step): each projection is one CPU grouped_mm instead of the loop's per-expert
    mm calls; the output and every gradient are the loop's to the bit (block_rows=3: the loop, several blocks)."""
    import torch.nn.functional as F

    ids, inputs = _moe_case(activation, dtype)
    up = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    grouped_calls = []
    grouped_mm = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: grouped_calls.append(1) or grouped_mm(*a, **k))

    def run(block_rows):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fused_moe(leaves[0], ids, *leaves[1:], activation, mode="tiles", block_rows=block_rows)
        (y.float() * up.float()).sum().backward()
        with torch.no_grad():
            y_eval = fused_moe(*[t.detach() for t in leaves[:1]], ids, *[t.detach() for t in leaves[1:]], activation,
                               mode="tiles", block_rows=block_rows)
        return [y.detach(), y_eval] + [t.grad for t in leaves]

    loop = run(3)
    assert not grouped_calls
    one_block = run(10_000)
    assert len(grouped_calls) == 4  # two projections, with and without grad
    for name, a, b in zip(["y", "y_no_grad", "dx", "dw", "dw_in", "dw_out"], one_block, loop):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("recompute", [False, True])
def test_fused_moe_gradcheck(activation, recompute):
    ids, inputs = _moe_case(activation, torch.float64, t=5, d=4, f=3, e=4)
    assert torch.autograd.gradcheck(lambda *a: fused_moe(a[0], ids, *a[1:], activation, mode="tiles", block_rows=3,
                                                         recompute=recompute),
                                    [t.requires_grad_() for t in inputs])


@pytest.mark.parametrize("mode", ["tiles", "grouped"])
def test_fused_moe_recompute_saves_no_pre_activation(mode):
    # Saved bytes counted with saved_tensors_hooks: recompute drops exactly h = [N, I] (N = T * K rows).
    from moetrain.analysis.saved import SavedTensorCounter

    ids, inputs = _moe_case("swiglu", torch.float32)
    x, w, w_in, w_out = [t.clone().requires_grad_() for t in inputs]
    saved = {}
    for recompute in (False, True):
        with SavedTensorCounter(exclude=[x, w_in, w_out]) as counter:
            fused_moe(x, ids, w, w_in, w_out, "swiglu", mode=mode, recompute=recompute)
        saved[recompute] = counter.total
    n_rows, width = ids.numel(), w_in.shape[1]
    assert saved[False] - saved[True] == n_rows * width * 4


@pytest.mark.parametrize("backend,capacity_factor", [("fused", None), ("fused", 0.8), ("loop", None),
                                                     ("grouped_mm", None), ("padded", 1.0)])
def test_layer_recompute_experts_changes_nothing(backend, capacity_factor):
    # Same outputs and gradients with and without recomputation, for the fused Function and the checkpointed
    # unfused paths (capacity drops go through the unfused dispatcher).
    d = 16
    outs = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(d, MoEConfig(num_experts=6, top_k=2, experts=ExpertsConfig(ffn_hidden=12),
                                      capacity=CapacityConfig(factor=capacity_factor)),
                         ExecutionConfig(moe_backend=backend, recompute_experts=recompute))
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.3)
        x = torch.randn(3, 7, d, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y, aux = layer(x)
        (y.square().sum() + aux.aux_loss).backward()
        outs[recompute] = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(outs[True], outs[False]):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max().clamp(min=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity_factor", [None, 0.8])  # dropless: fused layer path; dropping: fused experts
def test_layer_fused_backend_equals_loop(dtype, capacity_factor):
    torch.manual_seed(0)
    d = 16
    layers = {}
    for backend in ("fused", "loop"):
        torch.manual_seed(0)
        layer = MoELayer(d, MoEConfig(num_experts=6, top_k=2, experts=ExpertsConfig(ffn_hidden=12),
                                      capacity=CapacityConfig(factor=capacity_factor)),
                         ExecutionConfig(moe_backend=backend))
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.3)
        layers[backend] = layer.to(dtype)
    x = torch.randn(3, 7, d).to(dtype)
    outs = {}
    for backend, layer in layers.items():
        xs = x.clone().requires_grad_()
        y, aux = layer(xs)
        (y.float().square().sum() + aux.aux_loss).backward()
        outs[backend] = [y.detach().float(), xs.grad.float()] + [p.grad.float() for p in layer.parameters()]
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(outs["fused"], outs["loop"]):
        assert (a - b).abs().max() <= tol * b.abs().max().clamp(min=1.0)


def test_run_largest_first_runs_every_item_restores_threads_and_reraises():
    from moetrain.moe.kernels.cpu.workers import run_largest_first

    threads = torch.get_num_threads()
    seen = []

    def fn(item):
        if item == "bad":
            raise RuntimeError("boom")
        seen.append((item, torch.get_num_threads(), torch.is_grad_enabled()))

    torch.set_num_threads(2)
    try:
        run_largest_first(fn, list("abcde"), [1, 5, 2, 4, 3])
        assert sorted(i for i, _, _ in seen) == list("abcde") and not any(grad for _, _, grad in seen)
        assert all(n == 1 for _, n, _ in seen)  # single-threaded workers
        with pytest.raises(RuntimeError, match="boom"):
            run_largest_first(fn, ["a", "bad", "c"], [1, 2, 3])
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        seen.clear()
        run_largest_first(fn, list("abc"), [1, 3, 2])  # inline: largest first
        assert [i for i, _, _ in seen] == ["b", "c", "a"]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
def test_fused_moe_same_result_with_one_or_several_workers(dtype, recompute):
    ids, inputs = _moe_case("swiglu", dtype, t=40, d=16, f=8, k=2, e=6)
    threads = torch.get_num_threads()
    results = []
    for n in (1, max(threads, 2)):
        torch.set_num_threads(n)
        try:
            leaves = [t.clone().requires_grad_() for t in inputs]
            y = fused_moe(leaves[0], ids, *leaves[1:], "swiglu", mode="tiles", block_rows=9, recompute=recompute)
            y.float().square().sum().backward()
            results.append([y.detach()] + [t.grad for t in leaves])
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)


def test_pad_groups_hand_derived_layout():
    # bf16 CPU groups are padded (oneDNN compiles a kernel per GEMM shape). Hand-derived with 1 significant bit:
    # ids -> sorted rows: expert 0: tokens 0, 1, 2; expert 1: token 3; expert 2: tokens 0, 1, 2, 3. Counts 3, 1, 4
    # round up to 4, 1, 4: expert 0 is padded with its first token (0); the rows shift by 0, 1, 1 per expert.
    from moetrain.moe.fast_moe import pad_groups, route_dropless

    ids = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 1]])
    token_ids, rows_of, counts = route_dropless(ids, 3)
    assert token_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and counts.tolist() == [3, 1, 4]
    tok_pad, rows_pad, counts_pad = pad_groups(token_ids, rows_of, ids, counts, bits=1)
    assert counts_pad.tolist() == [4, 1, 4]
    assert tok_pad.tolist() == [0, 1, 2, 0, 3, 0, 1, 2, 3]
    assert rows_pad.tolist() == [[0, 5], [6, 1], [2, 7], [8, 4]]
    assert (tok_pad[rows_pad] == torch.arange(4)[:, None]).all()  # every assignment still finds its token


def test_padded_rows_bounds_waste_and_shapes():
    from moetrain.moe.fast_moe import padded_rows

    assert [padded_rows(c) for c in (0, 1, 15, 16, 17, 33, 100, 511, 513, 1000)] == [
        0, 1, 15, 16, 18, 36, 104, 512, 576, 1024]  # 4 leading bits: steps of 1, 1, 1, 2, 2, 4, 8, 32, 64, 64
    sizes = [padded_rows(c) for c in range(1, 8193)]
    assert all(p >= c and (p - c) * 8 < c for c, p in zip(range(1, 8193), sizes))  # under 1/8 more rows
    assert len(set(sizes)) <= 16 + 8 * 9  # 1..15, then 8 sizes per octave up to 8192


@pytest.mark.parametrize("recompute", [False, True])
def test_fused_moe_bf16_padding_changes_nothing(monkeypatch, recompute):
    # The same bf16 layer with and without padded groups: padding rows carry gating weight 0, so outputs and all
    # gradients agree (up to the GEMM's own blocking, which may differ with the row count).
    import moetrain.moe.fast_moe as fm

    ids, inputs = _moe_case("swiglu", torch.bfloat16, t=150, d=16, f=8, k=2, e=5)
    up = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    counts = fm.route_dropless(ids, 5)[2]
    assert fm.pad_groups(*fm.route_dropless(ids, 5)[:2], ids, counts)[2].sum() > counts.sum()  # padding happens

    def run():
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fused_moe(leaves[0], ids, *leaves[1:], "swiglu", mode="tiles", recompute=recompute)
        (y.float() * up.float()).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    padded = run()
    monkeypatch.setattr(fm, "_shape_stable", lambda x: False)
    plain = run()
    for name, a, b in zip(["y", "dx", "dw", "dw_in", "dw_out"], padded, plain):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2, msg=name)


@pytest.mark.parametrize("recompute", [False, True])
def test_fused_moe_bf16_with_experts_above_the_row_quantum_equals_loop(recompute):
    ids, inputs = _moe_case("swiglu", torch.bfloat16, t=150, d=16, f=8, k=2, e=5)  # ~100 rows per busy expert
    up = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        (y.float() * up.float()).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    got = run(lambda x, w, a, b: fused_moe(x, ids, w, a, b, "swiglu", mode="tiles", recompute=recompute))
    ref = run(lambda x, w, a, b: _unfused_moe(ids, "swiglu", x, w, a, b))
    for name, a, b in zip(["y", "dx", "dw", "dw_in", "dw_out"], got, ref):
        assert (a.float() - b.float()).abs().max() <= 3e-2 * b.float().abs().max().clamp(min=1.0), name

