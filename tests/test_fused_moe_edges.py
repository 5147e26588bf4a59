"""Edge cases of the fused MoE path (moe/fast_moe.py) on CPU: its kept scratch (moe/kernels/cpu/workspace.py), padded
bf16 / fp16 expert groups (``pad_groups``) and the largest-first worker queue (moe/kernels/cpu/workers.py).

- Kept scratch is never returned or saved: activation checkpointing (both kinds), ``retain_graph`` backward twice,
  anomaly mode and ``no_grad`` give bit-identical results to a plain call, two fused layers in one graph too.
- 1 vs 2 intra-op threads (several blocks on the queue), repeated runs and two Python threads calling at once give
  bit-identical outputs and gradients; the combine split across the workers gives the plain loop's sum. The
  default layer runs under ``torch.inference_mode``, ``no_grad`` and with gradients on 1-3 threads (the workers
  take on the caller's inference mode, which is thread-local).
- The workers are PyTorch's OpenMP threads where it runs on OpenMP (Linux wheels), else a thread pool: the tests of
  the queue run with both (``worker_kind``), and check that two workers really run at once, on distinct threads.
- A worker's exception (simulated out-of-memory) is re-raised and leaves nothing behind; an interrupt that arrives
  while the caller waits for the workers is raised only after every worker has stopped (they write into the
  caller's kept buffers).
- Padding rows (a repeat of the expert's first token, gating weight 0) spread no NaN / inf beyond what the unfused
  reference gets; T = 1 with K = E, all tokens on one expert and zero gating weights equal the reference in fp16.
- A second derivative through the fused Function raises instead of silently missing terms.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moetrain.moe import fast_moe
from moetrain.execution import ExecutionConfig
from moetrain.moe.config import ExpertsConfig, MoEConfig
from moetrain.moe.kernels.cpu import workers
from moetrain.moe.kernels.cpu.workers import run_largest_first
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.experts import loop_experts
from moetrain.moe.fast_moe import fused_moe
from moetrain.moe.layer import MoELayer


@pytest.fixture(params=["openmp", "pool"])
def worker_kind(request, monkeypatch):
    """The queue's workers: PyTorch's OpenMP team (skipped where there is none) or the thread pool."""
    if request.param == "pool":
        monkeypatch.setattr(workers, "_openmp_team", lambda: None)
    elif workers._openmp_team() is None:
        pytest.skip("PyTorch runs on no OpenMP runtime this module can start a team on")
    return request.param


def test_linux_wheels_get_the_openmp_team():
    # PyTorch's Linux wheels run intra-op work on libgomp: the fast path must be found there, not skipped silently.
    if sys.platform != "linux" or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("not PyTorch on OpenMP on Linux")
    assert workers._openmp_team() is not None


def test_two_workers_run_at_once_on_distinct_threads(worker_kind):
    # Each of the first two items waits until both have started: this finishes only if two workers run them at
    # the same time. Every item runs once, single-threaded and without gradient tracking.
    threads = torch.get_num_threads()
    both = threading.Barrier(2, timeout=10)
    seen = []

    def fn(item):
        seen.append((item, threading.get_ident(), torch.get_num_threads(), torch.is_grad_enabled()))
        if item in "ab":
            both.wait()

    try:
        torch.set_num_threads(2)
        run_largest_first(fn, list("abcd"), [4, 3, 2, 1])
        assert sorted(i for i, *_ in seen) == list("abcd")
        assert len({ident for i, ident, *_ in seen if i in "ab"}) == 2
        assert all(n == 1 and not grad for _, _, n, grad in seen)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_a_forked_child_runs_the_layer_after_the_parent_used_the_workers():
    # libgomp's threads do not survive a fork: a region started in the child would wait for them forever. The child
    # falls back to a thread pool of its own and gets the parent's result.
    ids, inputs, _ = _case(torch.float32, t=512, e=8, k=2, d=32, f=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            ref = _fused(ids)(*inputs)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if it finishes with the parent's bits
            try:
                with torch.no_grad():
                    os._exit(0 if torch.equal(_fused(ids)(*inputs), ref) else 1)
            finally:
                os._exit(2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish in 60 s")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_split_across_workers_is_the_plain_sum(monkeypatch, worker_kind, dtype):
    # The native combine splits the tokens across the workers above PARALLEL_SUM_K elements (0 here, so that a small
    # case takes that path): the same bits as one worker, and the plain loop's fp32 sum rounded once.
    g = torch.Generator().manual_seed(0)
    t, k, d = 300, 3, 40
    rows = torch.randn(t * k, d, generator=g).to(dtype)
    rows_of = torch.randperm(t * k, generator=g).view(t, k)
    native = fast_moe.cpu_kernels.supports(rows)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fast_moe._sum_k(rows, rows_of, native)
        monkeypatch.setattr(fast_moe, "PARALLEL_SUM_K", 0)
        torch.set_num_threads(2)
        split = fast_moe._sum_k(rows, rows_of, native)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, split)
    plain = torch.stack([sum((rows[rows_of[i, j]].float() for j in range(k)), torch.zeros(d)) for i in range(t)])
    if native or dtype == torch.float32:  # the ops' bf16 tree rounds per pair (see _sum_k)
        assert torch.equal(split, plain.to(dtype))


def _reference(ids, activation, x, w, w_in, w_out):
    """The unfused layer path: LocalDispatcher dropless dispatch -> per-expert loop -> weighted combine."""
    dispatcher = LocalDispatcher(w_in.shape[0])
    rows, counts, meta = dispatcher.dispatch(x, ids, w)
    return dispatcher.combine(loop_experts(rows, w_in, w_out, counts, activation), meta)


def _case(dtype, t, e, k, d=16, f=8, activation="swiglu", ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
    width = 2 * f if activation == "swiglu" else f
    x = torch.randn(t, d, generator=g).to(dtype)
    w_in = (torch.randn(e, width, d, generator=g) * 0.3).to(dtype)
    w_out = (torch.randn(e, d, f, generator=g) * 0.3).to(dtype)
    up = torch.randn(t, d, generator=g).to(dtype)  # upstream gradient
    return ids, [x, w, w_in, w_out], up


def _grads(fn, inputs, up):
    leaves = [v.clone().requires_grad_() for v in inputs]
    y = fn(*leaves)
    (y.float() * up.float()).sum().backward()
    return [y.detach()] + [v.grad for v in leaves]


def _fused(ids, activation="swiglu", **kw):
    return lambda x, w, a, b: fused_moe(x, ids, w, a, b, activation, mode="tiles", **kw)


def _bitwise(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def _layer(d, seed, dtype, recompute, backend="fused"):
    torch.manual_seed(seed)
    layer = MoELayer(d, MoEConfig(num_experts=6, top_k=2, experts=ExpertsConfig(ffn_hidden=12)),
                     ExecutionConfig(moe_backend=backend, recompute_experts=recompute))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer.to(dtype)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
def test_checkpointing_retain_graph_anomaly_and_no_grad_change_nothing(dtype, recompute):
    d = 16
    first, second = _layer(d, 0, dtype, recompute), _layer(d, 1, dtype, recompute)
    params = list(first.parameters()) + list(second.parameters())
    x = torch.randn(3, 7, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    up = torch.randn(3, 7, d, generator=torch.Generator().manual_seed(3))

    def model(z):  # two fused layers in one graph: each one's scratch is reused by the other
        return second(first(z)[0])[0]

    def run(wrap=None, twice=False):
        for p in params:
            p.grad = None
        xs = x.clone().requires_grad_()
        y = wrap(model, xs) if wrap else model(xs)
        loss = (y.float() * up).sum()
        loss.backward(retain_graph=twice)
        out = [y.detach(), xs.grad.clone()] + [p.grad.clone() for p in params]
        if twice:  # the same graph again: saved tensors must not have been overwritten by the first backward
            for p in params:
                p.grad = None
            xs.grad = None
            loss.backward()
            assert _bitwise(out, [y.detach(), xs.grad] + [p.grad for p in params])
        return out

    plain = run()
    for reentrant in (False, True):
        assert _bitwise(run(lambda f, z, r=reentrant: checkpoint(f, z, use_reentrant=r)), plain), reentrant
    assert _bitwise(run(twice=True), plain)
    with torch.autograd.detect_anomaly(check_nan=True):
        assert _bitwise(run(), plain)
    with torch.no_grad():
        assert torch.equal(model(x), plain[0])

    # And the fused layer itself against the unfused one (same weights, the loop backend).
    ref = _layer(d, 0, dtype, recompute, backend="loop")
    assert _bitwise(list(ref.parameters()), list(first.parameters()))
    outs = []
    for layer in (first, ref):
        layer.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        y = layer(xs)[0]
        (y.float() * up).sum().backward()
        outs.append([y.detach(), xs.grad] + [p.grad for p in layer.parameters()])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(*outs, strict=True):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max().clamp(min=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
def test_one_or_two_threads_repeated_and_concurrent_calls_are_bitwise_equal(dtype, recompute, worker_kind):
    # N = 1024 rows: with 2 threads the default blocks are cut to MIN_BLOCK_ROWS, so several go through the queue;
    # every block's kernels are single-threaded and SwiGLU's elementwise work is per row, so the blocking does not
    # change a single bit. Two Python threads share the worker pool and keep their own scratch.
    ids, inputs, up = _case(dtype, t=512, e=8, k=2, d=32, f=16)
    fn = _fused(ids, recompute=recompute)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _grads(fn, inputs, up)
        torch.set_num_threads(2)
        two = _grads(fn, inputs, up)
        assert _bitwise(one, two)
        assert _bitwise(_grads(fn, inputs, up), two)
        results, errors = [], []

        def caller():
            try:
                for _ in range(2):
                    results.append(_grads(fn, inputs, up))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        callers = [threading.Thread(target=caller) for _ in range(2)]
        for c in callers:
            c.start()
        for c in callers:
            c.join()
        assert not errors and len(results) == 4
        assert all(_bitwise(r, two) for r in results)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_layer_runs_under_inference_mode_no_grad_and_grad_on_any_thread_count(worker_kind, dtype):
    # The server steps its model under torch.inference_mode() at the default thread count. The buffers the fused
    # Function allocates there are inference tensors, and inference mode is thread-local: a worker that wrote them
    # outside it failed every request ("Inplace update to inference tensor outside InferenceMode"). At 1, 2 (at
    # least the default) and 3 threads every grad mode gives the same bits; a training step after inference calls
    # reuses the kept scratch.
    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, experts=ExpertsConfig(ffn_hidden=16))).to(dtype)
    x = torch.randn(4, 256, 32, generator=torch.Generator().manual_seed(0)).to(dtype)  # N = 2048 rows: 8 blocks
    threads = torch.get_num_threads()
    counts = sorted({1, 3, max(2, threads)})
    outs = {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            with torch.inference_mode():
                outs["inference", n] = layer(x)[0]
            with torch.no_grad():
                outs["no_grad", n] = layer(x)[0]
            xs = x.clone().requires_grad_()
            y = layer(xs)[0]
            y.float().square().sum().backward()
            outs["grad", n] = y.detach()
            outs["dx", n] = xs.grad
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(threads)
    for n in counts:
        assert torch.equal(outs["inference", n], outs["grad", n]) and torch.equal(outs["no_grad", n], outs["grad", n])
        for mode in ("grad", "dx"):  # the router's and the shared ops' own GEMMs may split differently per count
            torch.testing.assert_close(outs[mode, n], outs[mode, 1], rtol=1e-5, atol=1e-6)


def test_worker_failure_is_raised_and_leaves_nothing_behind(monkeypatch, worker_kind):
    ids, inputs, up = _case(torch.bfloat16, t=512, e=8, k=2, d=32, f=16)
    threads = torch.get_num_threads()
    real = fast_moe.scratch
    try:
        torch.set_num_threads(2)
        clean = _grads(_fused(ids), inputs, up)

        worker_failed = threading.Event()

        def failing(name, *args, **kwargs):  # out of memory in a pool worker's backward scratch
            if name.startswith("bwd."):
                if threading.current_thread() is not threading.main_thread():
                    worker_failed.set()
                    raise RuntimeError("simulated out of memory")
                # In a block (not the call's own [N, D] "bwd.dx"), the calling thread waits for the pool worker to
                # take one: otherwise it can finish every block first (the native kernels make blocks short).
                if name != "bwd.dx":
                    worker_failed.wait(timeout=10)
            return real(name, *args, **kwargs)

        monkeypatch.setattr(fast_moe, "scratch", failing)
        with pytest.raises(RuntimeError, match="simulated out of memory"):
            _grads(_fused(ids), inputs, up)
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(fast_moe, "scratch", real)
        assert _bitwise(_grads(_fused(ids), inputs, up), clean)
    finally:
        torch.set_num_threads(threads)


class _Interrupt(BaseException):
    pass


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_interrupt_while_waiting_for_workers_raises_only_after_they_stop(worker_kind):
    # A pool worker signals the calling thread while the caller, its own items done, waits for the worker. The
    # interrupt must not leave run_largest_first while the worker still runs: in the fused path it writes into
    # the caller's kept buffers, which the caller's next call reuses. (The sleeps only make the bad interleaving
    # likely; the assertions hold for any timing.)
    main = threading.main_thread()
    items = ["a", "b", "c"]
    log = []
    worker_started = threading.Event()

    def fn(item):
        if threading.current_thread() is main:
            worker_started.wait(10)  # the pool worker holds an item before the caller runs out of them
            log.append(("main", item))
            return
        worker_started.set()
        deadline = time.monotonic() + 10
        while sum(who == "main" for who, _ in log) < len(items) - 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # the caller is now waiting for this worker
        signal.pthread_kill(main.ident, signal.SIGINT)
        time.sleep(0.3)
        log.append(("worker done", item))

    def interrupt(signum, frame):
        raise _Interrupt

    threads = torch.get_num_threads()
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        torch.set_num_threads(2)
        with pytest.raises(_Interrupt):
            run_largest_first(fn, items, [3, 2, 1])
        assert log[-1][0] == "worker done", log
        assert torch.get_num_threads() == 2
    finally:
        signal.signal(signal.SIGINT, previous)
        torch.set_num_threads(threads)


def _finite_pattern(outs):
    """Which outputs / rows / gating weights / experts are finite: y and dx per token, dw per assignment, the weight
    gradients per expert."""
    y, dx, dw, d_in, d_out = (t.float() for t in outs)
    return [torch.isfinite(y).all(1), torch.isfinite(dx).all(1), torch.isfinite(dw),
            torch.isfinite(d_in).flatten(1).all(1), torch.isfinite(d_out).flatten(1).all(1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # the padded (shape-stable) path
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("where", ["x", "upstream"])
def test_non_finite_token_spreads_no_further_than_in_the_reference(dtype, activation, where):
    # Token 0 is the first token of both its experts, so their padding rows repeat it.
    ids, inputs, up = _case(dtype, t=20, e=6, k=2, activation=activation)
    (inputs[0] if where == "x" else up)[0, 5] = float("nan")
    (inputs[0] if where == "x" else up)[7, 2] = float("inf")
    for recompute in (False, True):
        got = _grads(_fused(ids, activation, recompute=recompute), inputs, up)
        ref = _grads(lambda *a: _reference(ids, activation, *a), inputs, up)
        got_finite, ref_finite = _finite_pattern(got), _finite_pattern(ref)
        for a, b in zip(got_finite, ref_finite, strict=True):
            assert torch.equal(a, b)
        assert ref_finite[3].sum() >= 2  # some experts never saw the bad tokens, and kept finite gradients
        for g, r, ok in zip(got, ref, ref_finite, strict=True):
            g, r = g.float()[ok], r.float()[ok]
            assert (g - r).abs().max() <= 3e-2 * r.abs().max().clamp(min=1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ["T=1,K=E", "one expert", "zero weights"])
def test_edge_routings_equal_the_reference(dtype, routing):
    if routing == "T=1,K=E":
        ids, inputs, up = _case(dtype, t=1, e=5, k=5)
    elif routing == "one expert":  # 70 rows: padded past a power of two on the bf16 / fp16 path; 3 idle experts
        ids, inputs, up = _case(dtype, t=70, e=4, k=1, ids=torch.full((70, 1), 2))
    else:
        ids, inputs, up = _case(dtype, t=30, e=6, k=3)
        inputs[1][::3, 1] = 0.0  # exactly zero gating weights still get their exact gradient
    for recompute in (False, True):
        got = _grads(_fused(ids, recompute=recompute), inputs, up)
        ref = _grads(lambda *a: _reference(ids, "swiglu", *a), inputs, up)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for name, a, b in zip(["y", "dx", "dw", "dw_in", "dw_out"], got, ref, strict=True):
            assert torch.isfinite(a.float()).all(), name
            assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max().clamp(min=1.0), name
        if routing == "one expert":
            for grad in got[3:]:
                assert grad[[0, 1, 3]].abs().max() == 0  # idle experts: exact zeros


def test_second_derivative_raises_instead_of_being_silently_incomplete():
    # The hand-written backward is not differentiable; with create_graph=True the unfused path would give the
    # penalty's gradient, the fused one must refuse rather than drop it.
    ids, inputs, _ = _case(torch.float32, t=10, e=4, k=2)
    x, w, w_in, w_out = [v.clone().requires_grad_() for v in inputs]
    y = fused_moe(x, ids, w, w_in, w_out, mode="tiles")
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (y.sum() + gx.square().sum()).backward()


def test_fused_experts_second_derivative_raises():
    # The same for the standalone experts Function (the fused backend's path with a capacity factor).
    from moetrain.moe.fast_moe import fused_experts

    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 8, generator=g, requires_grad=True)
    w_in = torch.randn(3, 8, 8, generator=g, requires_grad=True)
    w_out = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    y = fused_experts(x, w_in, w_out, torch.tensor([5, 0, 7]), mode="tiles")
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (y.sum() + gx.square().sum()).backward()
