"""The native CPU SwiGLU kernels (moe/kernels/cpu/native.py, native.c): against an fp64 PyTorch reference, special
values, argument checks, the build cache and the fallback, and the fused MoE layer with and without them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetrain.moe.kernels.cpu import native as cpu_kernels
from moetrain.moe.fast_moe import fused_moe

HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_kernels = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the kernels cannot be built here")


def _reference(h, dz, w):
    """fp64: a = w silu(g) u, dh = [w dz u silu'(g) | w dz silu(g)], dw = sum dz silu(g) u; and the magnitude of
    dh's terms (silu'(g) = s (1 + g (1 - s)) cancels near g = -1.28, in any fp32 evaluation)."""
    f = h.shape[1] // 2
    g, u = h.double()[:, :f], h.double()[:, f:]
    dz, w = dz.double(), w.double()[:, None]
    s = torch.sigmoid(g)
    act = g * s * u
    dg = w * dz * u * s * (1 + g * (1 - s))
    du = w * dz * g * s
    mag = (w * dz * u * s).abs() * (1 + g.abs() * (1 - s))
    return w * act, torch.cat([dg, du], dim=1), (dz * act).sum(dim=1), torch.cat([mag, du.abs()], dim=1)


def _inputs(n, f, dtype, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, 2 * f, generator=gen) * scale).to(dtype)
    dz = torch.randn(n, f, generator=gen).to(dtype)
    w = torch.rand(n, generator=gen).to(dtype)
    if n > 1:
        w[1] = 0  # a padding row (moe/fast_moe.py: pad_groups)
    return h, dz, w


def _close(got, ref, dtype, what, mag=None):
    """Relative to ``mag`` (default |ref|): fp32 1e-6 (a few ulp of a handful of fp32 operations); bf16 half a bf16
    ulp, 2^-8 relative, plus the fp32 error (one rounding of an fp32 result). Values below 1e-30 count as 0 (exp
    underflows there, in PyTorch's silu as well)."""
    got, ref = got.double(), ref.double()
    mag = ref.abs() if mag is None else mag
    tol = (1e-6 if dtype == torch.float32 else 2.0**-8 * 1.001) * mag + 1e-30
    bad = (got - ref).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} values off, e.g. {got[bad][:3].tolist()} vs {ref[bad][:3].tolist()}"


@needs_kernels
def test_the_kernels_build_where_a_compiler_exists():
    assert cpu_kernels.available()
    assert cpu_kernels.supports(torch.zeros(1, dtype=torch.bfloat16), "swiglu")
    assert not cpu_kernels.supports(torch.zeros(1, dtype=torch.float16), "swiglu")  # fp16: PyTorch ops
    assert not cpu_kernels.supports(torch.zeros(1), "gelu")
    assert not cpu_kernels.supports(torch.zeros(1, dtype=torch.float64), "swiglu")
    assert not cpu_kernels.supports(torch.zeros(1, device="meta"), "swiglu")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,f", [(0, 16), (1, 1), (3, 15), (5, 16), (7, 17), (4, 40), (64, 512)])
def test_forward_and_backward_match_fp64(dtype, n, f):
    h, dz, w = _inputs(n, f, dtype, seed=n * 100 + f)
    ref_a, ref_dh, ref_dw, mag = _reference(h, dz, w)
    a = torch.full((n, f), 7.0, dtype=dtype)
    cpu_kernels.swiglu_forward(h, w, a)
    _close(a, ref_a, dtype, "forward")
    aw, dh, dw = torch.empty(n, f, dtype=dtype), torch.empty(n, 2 * f, dtype=dtype), torch.empty(n)
    cpu_kernels.swiglu_backward(h, dz, w, aw, dh, dw)
    _close(aw, ref_a, dtype, "w * a")
    _close(dh, ref_dh, dtype, "dh", mag)
    # dw: an fp32 sum of F products of (rounded) inputs: bounded by the sum of magnitudes, not the result
    mag = (dz.double().abs() * (h.double()[:, :f].abs() * h.double()[:, f:].abs())).sum(dim=1)
    assert ((dw.double() - ref_dw).abs() <= 1e-6 * mag + 1e-30).all()
    if n > 1:
        assert (a[1] == 0).all() and (dh[1] == 0).all()  # weight 0: a padding row contributes exactly nothing


@needs_kernels
def test_outputs_left_out_are_not_written_and_inputs_are_not_modified():
    h, dz, w = _inputs(6, 20, torch.float32)
    copies = [t.clone() for t in (h, dz, w)]
    dh = torch.empty(6, 40)
    cpu_kernels.swiglu_backward(h, dz, w, None, dh, None)
    ref = _reference(h, dz, w)
    _close(dh, ref[1], torch.float32, "dh", ref[3])
    assert all(torch.equal(a, b) for a, b in zip(copies, (h, dz, w), strict=True))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_follow_pytorch(dtype):
    # silu across the whole float range, including where exp over- and underflows, infinities and NaN.
    g = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-3, 0.5, -0.5, 5.0, -5.0, 20.0, -20.0, 87.0, -87.0, 87.5, -87.5,
                      88.5, -88.5, 89.0, -89.0, 100.0, -100.0, 1e4, -1e4, 3e38, -3e38, float("inf"), float("-inf"),
                      float("nan")])
    g = torch.cat([g, torch.linspace(-120, 120, 4001)]).to(dtype)
    n = g.numel()
    h = torch.stack([g, torch.ones_like(g)], dim=1)  # f = 1: up = 1
    w = torch.ones(n, dtype=dtype)
    a = torch.empty(n, 1, dtype=dtype)
    cpu_kernels.swiglu_forward(h, w, a)
    expected = F.silu(g.double())
    got = a[:, 0].double()
    assert torch.equal(got.isnan(), expected.isnan())  # NaN, and -inf * 0 as PyTorch's silu(-inf)
    finite = ~expected.isnan()
    assert torch.equal(got[finite].isinf(), expected[finite].isinf())
    ok = finite & ~expected.isinf()
    _close(got[ok], expected[ok], dtype, "silu")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_negative_zero_gating_weight_keeps_its_sign(dtype):
    # w * silu(g) * u with w = -0.0: the sign of a zero product is the XOR of the factors' signs, as in PyTorch.
    # (The kernels broadcast scalars with x - (+0), which keeps -0; x + 0 would have turned it into +0.)
    torch.manual_seed(0)
    n, f = 6, 19  # f not a multiple of the vector width: the tail runs through the same code
    h = torch.randn(n, 2 * f).to(dtype)
    w = torch.tensor([-0.0, 0.0, -0.0, 1.0, -1.0, -0.0], dtype=dtype)
    a = torch.empty(n, f, dtype=dtype)
    cpu_kernels.swiglu_forward(h, w, a)
    expected = (F.silu(h[:, :f].double()) * h[:, f:].double()) * w.double()[:, None]
    assert torch.equal(torch.signbit(a), torch.signbit(expected))


@needs_kernels
def test_silu_keeps_fp32_precision_up_to_where_exp_overflows():
    # exp(-g) in sigmoid stays finite down to g = -88.72 (ln of the largest float); silu(g) there is ~1e-37, a
    # normal float, which PyTorch's silu gets right. (exp clamped at 88 was up to 2x off below g = -88.)
    g = torch.cat([torch.linspace(-88.72283, 88.72283, 20001), torch.linspace(-88.72283, -86.0, 2001)])
    n = g.numel()
    h = torch.stack([g, torch.ones(n)], dim=1)  # up = 1
    a, dh = torch.empty(n, 1), torch.empty(n, 2)
    cpu_kernels.swiglu_forward(h, torch.ones(n), a)
    cpu_kernels.swiglu_backward(h, torch.ones(n, 1), torch.ones(n), None, dh, None)  # du = dz w silu(g)
    expected = F.silu(g.double())
    assert (expected.abs() > 1e-38).sum() > n - 3  # normal floats (all but g = 0)
    for got in (a[:, 0], dh[:, 1]):
        assert ((got.double() - expected).abs() <= 1e-6 * expected.abs()).all()


@needs_kernels
def test_bf16_outputs_round_to_nearest_even_like_pytorch():
    # With gate >= 32, sigmoid is exactly 1 in fp32, so a = gate * up * w, a product of three bf16 values: exact in
    # fp32 (24 significant bits) and rounded once to bf16 by the kernel. PyTorch's fp32 -> bf16 conversion is the
    # reference: ties to even, overflow to inf (bf16's largest value times a little over 1 is past the halfway point).
    gen = torch.Generator().manual_seed(0)
    n = 20000

    def bf16(lo, hi):  # uniformly random bit patterns in [lo, hi)
        return torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    gate, up, w = bf16(0x4200, 0x7F80), bf16(0x3580, 0x4980), bf16(0x3580, 0x3F80)  # [32, max], [2^-20, 2^20)
    up[::2] *= -1
    gate[:500], up[:500], w[:500] = 3.3895e38, bf16(0x3F80, 0x3F82)[:500], 1.0
    a = torch.empty(n, 1, dtype=torch.bfloat16)
    cpu_kernels.swiglu_forward(torch.stack([gate, up], dim=1), w, a)
    product = gate.float() * up.float() * w.float()
    exact = (gate.double() * up.double() * w.double()).abs() < 3.4e38  # no fp32 overflow: the product is exact
    assert exact.sum() > n * 0.9 and a[:500].isinf().any() and a.isfinite().sum() > n * 0.8
    assert torch.equal(a[exact, 0].view(torch.int16), product[exact].to(torch.bfloat16).view(torch.int16))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,d", [(1, 5), (2, 16), (3, 33), (8, 64)])
def test_sum_k_is_the_ordered_fp32_sum_of_the_gathered_rows(dtype, k, d):
    gen = torch.Generator().manual_seed(k * 100 + d)
    t, n = 37, 150
    rows = torch.randn(n, d, generator=gen).to(dtype)
    rows_of = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(t)])
    acc = rows.float()[rows_of[:, 0]]
    for q in range(1, k):  # a plain loop: gather, add in fp32, k by k
        acc = acc + rows.float()[rows_of[:, q]]
    out = torch.full((t, d), 5.0, dtype=dtype)
    cpu_kernels.sum_k(rows, rows_of, out)
    assert torch.equal(out, acc.to(dtype))  # fp32: bit for bit; bf16: the fp32 sum rounded once
    part = torch.full((t, d), 5.0, dtype=dtype)
    cpu_kernels.sum_k(rows, rows_of, part, 10, 20)  # a worker's share of the tokens: only those rows written
    assert torch.equal(part[10:20], out[10:20]) and (part[:10] == 5).all() and (part[20:] == 5).all()


def _layout_by_loop(ids, e):
    """The dropless layout by a plain loop: expert by expert, its assignments in flat (token, k) order."""
    t, k = ids.shape
    flat = ids.reshape(-1).tolist()
    rows = [i for x in range(e) for i, y in enumerate(flat) if y == x]  # row r holds assignment rows[r]
    rows_of = [0] * len(flat)
    for r, i in enumerate(rows):
        rows_of[i] = r
    return (torch.tensor([i // k for i in rows], dtype=torch.int64).reshape(-1),
            torch.tensor(rows_of, dtype=torch.int64).view(t, k), torch.bincount(ids.reshape(-1), minlength=e))


@needs_kernels
@pytest.mark.parametrize("t,k,e", [(0, 2, 8), (1, 1, 1), (37, 2, 8), (200, 8, 64), (50, 3, 128)])
def test_route_dropless_is_the_stable_layout_of_a_plain_loop_and_of_the_sort(monkeypatch, t, k, e):
    from moetrain.moe import dispatch

    gen = torch.Generator().manual_seed(t + k + e)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
    got = cpu_kernels.route_dropless(ids, e)
    for a, b in zip(got, _layout_by_loop(ids, e), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(dispatch.route_dropless(ids, e), got, strict=True))
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)  # the torch.sort path
    assert all(torch.equal(a, b) for a, b in zip(dispatch.route_dropless(ids, e), got, strict=True))
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 3\)"):
        cpu_kernels.route_dropless(torch.tensor([[0, 1], [2, 3]]), 3)
    with pytest.raises(ValueError, match="topk_ids: .*int64"):
        cpu_kernels.route_dropless(torch.tensor([[0, 1]], dtype=torch.int32), 3)


def test_bad_arguments_raise_before_touching_memory():
    h, dz, w = _inputs(4, 8, torch.float32)
    with pytest.raises(ValueError, match="a: expected a contiguous CPU torch.float32 tensor of shape"):
        cpu_kernels.swiglu_forward(h, w, torch.empty(8, 4).T)  # not contiguous
    with pytest.raises(ValueError, match=r"h: .*shape \(4, 8\)"):
        cpu_kernels.swiglu_forward(h, w, torch.empty(4, 4))  # h is [4, 16]: F = 8, not 4
    with pytest.raises(ValueError, match="w: "):
        cpu_kernels.swiglu_forward(h, w.double(), torch.empty(4, 8))
    with pytest.raises(ValueError, match="dw: "):
        cpu_kernels.swiglu_backward(h, dz, w, None, torch.empty(4, 16), torch.empty(4, dtype=torch.float64))
    rows, out = torch.zeros(6, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"rows outside \[0, 6\)"):
        cpu_kernels.sum_k(rows, torch.tensor([[0, 6], [1, 2]]), out)
    with pytest.raises(ValueError, match=r"rows outside"):
        cpu_kernels.sum_k(rows, torch.tensor([[0, -1], [1, 2]]), out)
    with pytest.raises(ValueError, match="rows_of: .*int64"):
        cpu_kernels.sum_k(rows, torch.tensor([[0, 1], [1, 2]], dtype=torch.int32), out)
    with pytest.raises(ValueError, match="token range"):
        cpu_kernels.sum_k(rows, torch.tensor([[0, 1], [1, 2]]), out, 1, 3)


def test_outputs_that_share_memory_with_another_argument_are_refused():
    # The kernels read inputs while they write outputs, row by row: an overlap would make the result depend on the
    # traversal order. Refused before the call, so nothing is written.
    h, dz, w = _inputs(4, 8, torch.float32)
    before = h.clone()
    with pytest.raises(ValueError, match="a: shares memory with h"):
        cpu_kernels.swiglu_forward(h, w, h.view(-1)[:32].view(4, 8))
    with pytest.raises(ValueError, match="dh: shares memory with h"):
        cpu_kernels.swiglu_backward(h, dz, w, None, h, None)
    buf = torch.empty(4 * 8 + 4 * 16)  # aw and dh side by side in one buffer: disjoint, accepted ...
    aw, dh = buf[:32].view(4, 8), buf[32:].view(4, 16)
    cpu_kernels.swiglu_backward(h, dz, w, aw, dh, None)
    with pytest.raises(ValueError, match="aw: shares memory with dh"):  # ... overlapping by one element: refused
        cpu_kernels.swiglu_backward(h, dz, w, buf[1:33].view(4, 8), dh, None)
    with pytest.raises(ValueError, match="dw: shares memory with w"):
        cpu_kernels.swiglu_backward(h, dz, w, None, torch.empty(4, 16), w)
    rows = torch.randn(6, 3)
    with pytest.raises(ValueError, match="out: shares memory with rows"):
        cpu_kernels.sum_k(rows, torch.tensor([[0, 1], [2, 3]]), rows[4:])
    assert torch.equal(h, before)


def test_unsupported_dtypes_ranks_and_non_tensors_raise_clear_errors():
    # They reached the raw-pointer call's dispatch (fp64, fp16: a RuntimeError saying the kernels were
    # "unavailable: None") or unpacked shapes blindly ("not enough values to unpack", AttributeError).
    h, dz, w = _inputs(4, 8, torch.float32)
    for dt in (torch.float64, torch.float16, torch.int32):
        with pytest.raises(ValueError, match=f"h: the native kernels take torch.float32 or torch.bfloat16, got {dt}"):
            cpu_kernels.swiglu_forward(h.to(dt), w.to(dt), torch.empty(4, 8, dtype=dt))
        with pytest.raises(ValueError, match=f"h: .*got {dt}"):
            cpu_kernels.swiglu_backward(h.to(dt), dz.to(dt), w.to(dt), None, h.to(dt), None)
        with pytest.raises(ValueError, match=f"rows: .*got {dt}"):
            cpu_kernels.sum_k(h.to(dt), torch.zeros(2, 1, dtype=torch.long), torch.empty(2, 16, dtype=dt))
    with pytest.raises(ValueError, match=r"a: expected a 2-D CPU tensor, got torch.float32 \(32,\)"):
        cpu_kernels.swiglu_forward(h, w, torch.empty(32))
    with pytest.raises(ValueError, match="dz: expected a 2-D"):
        cpu_kernels.swiglu_backward(h, dz.reshape(1, 4, 8), w, None, h, None)
    with pytest.raises(ValueError, match="rows_of: expected a 2-D"):
        cpu_kernels.sum_k(h, torch.tensor([0, 1]), torch.empty(2, 16))
    with pytest.raises(TypeError, match="h: expected a CPU tensor, got ndarray"):
        cpu_kernels.swiglu_forward(h.numpy(), w, torch.empty(4, 8))
    with pytest.raises(TypeError, match="w: .*got NoneType"):
        cpu_kernels.swiglu_forward(h, None, torch.empty(4, 8))
    with pytest.raises(ValueError, match="rows_of: expected K >= 1"):
        cpu_kernels.sum_k(h, torch.empty(2, 0, dtype=torch.long), torch.empty(2, 16))
    with pytest.raises(TypeError, match="first / last must be integers"):
        cpu_kernels.sum_k(h, torch.zeros(2, 1, dtype=torch.long), torch.empty(2, 16), 0.5, 2)


def _fresh_state(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_library", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_why_not", None)


@needs_kernels
def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
    _fresh_state(monkeypatch, tmp_path)
    assert cpu_kernels.library() is not None
    built = sorted((tmp_path / "kernels").iterdir())  # the library and its digest, no temporary file left behind
    assert len(built) == 2 and built[0].suffix == ".so" and built[1].name == built[0].name + ".sha256"
    stamp = built[0].stat().st_mtime_ns
    _fresh_state(monkeypatch, tmp_path)  # a new process, in effect: loads the cached build, compiles nothing
    calls = []
    real_run = cpu_kernels.subprocess.run
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    assert cpu_kernels.library() is not None
    assert calls == [[*cpu_kernels._compiler(), "--version"]] and built[0].stat().st_mtime_ns == stamp


@needs_kernels
def test_cc_may_carry_arguments(monkeypatch, tmp_path):
    # $CC is a command line by convention (CC="ccache gcc", "gcc -m64"): it was run as one file name.
    _fresh_state(monkeypatch, tmp_path)
    cc = next(shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c))
    monkeypatch.setenv("CC", f"{cc} -DMOETRAIN_CC_ARGUMENT=1")
    calls = []
    real_run = cpu_kernels.subprocess.run
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    assert cpu_kernels.library() is not None
    assert calls[-1][:2] == [cc, "-DMOETRAIN_CC_ARGUMENT=1"] and "-o" in calls[-1]


@needs_kernels
@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_cached_library_is_built_anew_not_loaded(monkeypatch, tmp_path, damage):
    # A crash or power loss can leave the cached library cut short. Loading a truncated library is no mere error:
    # the dynamic loader maps the segments past its end and the process dies of SIGBUS. A fresh process must rebuild
    # it instead (run as a subprocess, so that a regression cannot kill the test run).
    _fresh_state(monkeypatch, tmp_path)
    assert cpu_kernels.library() is not None
    (built,) = (tmp_path / "kernels").glob("*.so")
    whole = built.read_bytes()
    damaged = tmp_path / "damaged"
    damaged.write_bytes(whole[: len(whole) // 2] if damage == "truncated" else b"")
    os.replace(damaged, built)  # a new file: this process has the old one mapped
    code = "from moetrain.moe.kernels.cpu import native as c; import sys; sys.exit(0 if c.library() is not None else 3)"
    env = dict(os.environ, MOETRAIN_CACHE=str(tmp_path), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert cpu_kernels._intact(built) and built.read_bytes() == whole and len(list(built.parent.iterdir())) == 2


@needs_kernels
def test_an_unwritable_cache_falls_back_to_a_private_temporary_directory_only(monkeypatch, tmp_path):
    # The cache directory exists but cannot be written (read-only; os.access stands in for the file mode, which root
    # would ignore): build in <tmp>/moetrain-<uid> instead. That directory must be this user's alone: whoever can
    # write to it could put their own library there, and it would run inside this process.
    _fresh_state(monkeypatch, tmp_path / "cache")
    cache = tmp_path / "cache" / "kernels"
    cache.mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != cache and real_access(p, mode, **kw))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(cpu_kernels.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert cpu_kernels.library() is not None
    (private,) = (tmp_path / "tmp").iterdir()
    assert sorted(p.suffix for p in private.iterdir()) == [".sha256", ".so"] and not any(cache.iterdir())
    assert private.stat().st_mode & 0o077 == 0
    _fresh_state(monkeypatch, tmp_path / "cache")
    os.chmod(private, 0o777)  # as if someone else had made it: the library in it is not loaded
    with pytest.warns(RuntimeWarning, match="not a private directory"):
        assert cpu_kernels.library() is None


@needs_kernels
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Python >= 3.12: fork() of a multi-threaded process
def test_a_child_forked_while_another_thread_builds_does_not_wait_forever(monkeypatch, tmp_path):
    # Another thread of the parent is building (first call made, lock held) when the process forks: in the child
    # that thread does not exist, so the lock is never released and the build never finishes.
    _fresh_state(monkeypatch, tmp_path)
    monkeypatch.setattr(cpu_kernels, "_tried", True)
    monkeypatch.setattr(cpu_kernels, "_lock", threading.Lock())
    cpu_kernels._lock.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # the child: build (or load) the kernels itself
            status = 1
            try:
                status = 0 if cpu_kernels.library() is not None else 2
            finally:
                os._exit(status)
        deadline = time.monotonic() + 120
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waited for the parent's build lock")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        cpu_kernels._lock.release()


def test_without_a_compiler_the_layer_falls_back_with_one_warning(monkeypatch, tmp_path):
    ids, x, w, w_in, w_out, up = _layer_case(torch.float32)
    monkeypatch.setenv("MOETRAIN_CPU_KERNELS", "0")
    expected = _run(ids, x, w, w_in, w_out, up)
    monkeypatch.delenv("MOETRAIN_CPU_KERNELS")
    _fresh_state(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="native CPU MoE kernels unavailable"):
        assert not cpu_kernels.available()
    assert not cpu_kernels.supports(x, "swiglu")
    got = _run(ids, x, w, w_in, w_out, up)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))  # the PyTorch-op path, bit for bit
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


@pytest.mark.skipif(not shutil.which("false"), reason="no `false` command")
def test_a_compiler_failing_without_output_still_says_why(monkeypatch, tmp_path):
    # A failing $CC that prints nothing gave "the build failed: <flags>:  | <flags>: ", with no reason at all.
    _fresh_state(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", shutil.which("false"))
    with pytest.warns(RuntimeWarning, match=r"exit status 1: no output .*MOETRAIN_CPU_KERNELS=0 skips the kernels"):
        assert not cpu_kernels.available()


def _layer_case(dtype, t=300, e=6, k=2, d=24, f=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    x = torch.randn(t, d, generator=gen).to(dtype)
    w_in = (torch.randn(e, 2 * f, d, generator=gen) * 0.3).to(dtype)
    w_out = (torch.randn(e, d, f, generator=gen) * 0.3).to(dtype)
    up = torch.randn(t, d, generator=gen)
    return ids, x, w, w_in, w_out, up


def _run(ids, x, w, w_in, w_out, up, recompute=False, weights_grad=True):
    x, w_in, w_out = (p.clone().requires_grad_() for p in (x, w_in, w_out))
    w = w.clone().requires_grad_(weights_grad)
    y = fused_moe(x, ids, w, w_in, w_out, mode="tiles", recompute=recompute)
    (y.float() * up).sum().backward()
    return [y.detach(), x.grad, w_in.grad, w_out.grad] + ([w.grad] if weights_grad else [])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("weights_grad,k", [(True, 2), (False, 2), (True, 4)])
def test_fused_layer_with_and_without_the_kernels_agree(monkeypatch, dtype, recompute, weights_grad, k):
    case = _layer_case(dtype, k=k)
    used = []
    for name in ("swiglu_forward", "swiglu_backward", "sum_k"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _n=name, _f=real, **kw: used.append(_n) or _f(*a, **kw))
    with_kernels = _run(*case, recompute=recompute, weights_grad=weights_grad)
    assert set(used) == {"swiglu_forward", "swiglu_backward", "sum_k"}  # the kernels did run
    monkeypatch.setenv("MOETRAIN_CPU_KERNELS", "0")
    used.clear()
    without = _run(*case, recompute=recompute, weights_grad=weights_grad)
    assert not used
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the PyTorch ops round after every op, the kernels once
    for a, b in zip(with_kernels, without, strict=True):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max().clamp(min=1.0)



@pytest.mark.skipif(os.name != "posix", reason="a shell-script stand-in for the compiler")
def test_a_compiler_that_writes_no_library_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    # `CC=true`-like: exit status 0, no output file. The empty build used to be cached with its digest, and every
    # later process then failed to load it ("file too short") and warned again.
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    _fresh_state(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="the build does not load"):
        assert cpu_kernels.library() is None
    kernels = tmp_path / "cache" / "kernels"
    assert not kernels.exists() or list(kernels.iterdir()) == []
