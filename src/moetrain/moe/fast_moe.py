"""The fused routed-expert Function (the ``fused`` backend): experts with a hand-written backward, and on one device
dispatch + experts + combine as one autograd Function (the default CPU path; design and measured figures:
docs/performance.md).

Legend: T = tokens, D = hidden, E = experts, K = top-k, N = T * K rows (assignments, grouped by expert), F = expert
FFN hidden, I = input-projection width (2F for SwiGLU, F for GELU), n = rows of one block of experts.

:func:`fused_moe` (through :class:`FusedLocalDispatcher`, dropless on one device) computes what LocalDispatcher
dropless dispatch -> routed experts -> gating-weighted combine computes (same stable sort, same row order),
``out[t] = sum_k w[t, k] * expert_{e(t,k)}(x[t])``; :func:`fused_experts` runs the same Function on rows a
dispatcher laid out (a capacity factor, expert parallelism), each row a "token" routed to its own expert with
weight 1 (exact). Unlike the unfused layer:

- **No [N, D] copy of the input is kept**: rows are gathered per block of consecutive experts (about
  :data:`BLOCK_ELEMENTS` scratch elements) right before its GEMMs, and again in backward; only the pre-activation
  ``h`` [N, I] is saved (nothing with ``recompute``), and the activation is recomputed from it in backward.
- **The gating weight scales the activation** before the down projection (``(w * a) @ W_down^T``), so the combine
  is a plain sum of K gathered rows (:func:`_sum_k`, fixed order: deterministic) and dL/dw comes from the same tiles.
  In bf16 the weight is rounded to bf16 once (relative error 2^-9, the rounding the activation already had); the
  unfused path multiplies the bf16 expert output by the fp32 weight.

Execution: ``tiles`` mode (CPU) runs one ``torch.mm`` per expert and projection (counts read on the host; in bf16 /
fp16 each expert's rows padded to one of a few sizes, :func:`pad_groups`), blocks handed largest-first to
single-threaded workers (moe/kernels/cpu/workers.py), scratch reused between calls (workspace.py), 2 MiB pages for
large buffers (hugepages.py) and the elementwise work in native code where available (native.py); a few rows in one
block (a decode step: :data:`GROUPED_MAX_ROWS`) run each projection as one CPU ``grouped_mm``, with those ``mm`` calls
inside and no Python between them (the same products, bit for bit: tests/test_perf_experts.py). ``grouped`` mode
runs each projection as one ``torch.nn.functional.grouped_mm`` with device offsets (no host sync; CUDA bf16). Both
are tested against the unfused layer (tests/test_perf_experts.py).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moetrain.moe.dispatch import LocalDispatcher, route_dropless
from moetrain.moe.expert_ops import (
    ACTIVATIONS,
    act_forward,
    act_grad,
    act_recompute,
    compute_dtype,
    grouped_mm_aligned,
    zero_idle,
)
from moetrain.moe.kernels.cpu import hugepages
from moetrain.moe.kernels.cpu import native as cpu_kernels
from moetrain.moe.kernels.cpu.workers import run_largest_first, workers_for
from moetrain.moe.kernels.cpu.workspace import scratch

if TYPE_CHECKING:  # experts.py imports this module for its ``fused`` backend
    from moetrain.moe.experts import RoutedExperts

# Size of a block of the tiles mode (see _blocks), in elements of its widest [rows, max(I, D)] scratch buffer:
# 4M elements (8 MiB in bf16) gave the best times on a 2-core Sapphire Rapids at E = 8 (2048 rows per block) and
# E = 64 (8192 rows); whole-layer blocks (full-size temporaries) and per-expert blocks (op-call overhead at large
# E) were both slower.
BLOCK_ELEMENTS = 1 << 22
# With several CPU workers, blocks are also cut to about 1 / (BLOCKS_PER_WORKER * workers) of the rows (but not below
# MIN_BLOCK_ROWS), so that each worker takes several and none waits long for the last one (moe/kernels/cpu/workers.py).
BLOCKS_PER_WORKER = 4
MIN_BLOCK_ROWS = 256
MODES = ("auto", "tiles", "grouped")

# The native combine reads T * K * D elements; below this many it runs on the calling thread alone: handing out the
# shares cost more than it saves (2 cores, fp32, T = 4096, K = 2, D = 64: 0.26 ms inline, 0.63 ms on 2 workers;
# K = 8, D = 512: 7.5 / 2.3 ms).
PARALLEL_SUM_K = 1 << 22

_Block = tuple[int, int, list[tuple[int, int, int]]]  # (first row, rows, [(expert, first row in the block, rows)])
_Needs = tuple[bool, bool, bool, bool]  # gradients wanted: x rows, gating weights, w_in, w_out
_RowGrads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _sum_k(rows: torch.Tensor, rows_of: torch.Tensor, native: bool = False) -> torch.Tensor:
    """out[t] = sum_k rows[rows_of[t, k]]: [N, D] -> [T, D] in rows' dtype, in a fixed order (deterministic).

    fp32 / fp64 accumulate in k order. bf16 / fp16 add the K gathered [T, D] slices pairwise (a tree): each add
    computes in fp32 and rounds once, so K <= 2 rounds exactly once, as an fp32 accumulation would, and larger K
    ceil(log2 K) times. (An fp32 accumulator would need a converted copy of every operand, and a reduction over
    a [T, K, D] view runs ~3x slower than these adds on CPU.)

    ``native`` (CPU fp32 / bf16, moe/kernels/cpu/native.py available): one pass of :func:`cpu_kernels.sum_k` per worker
    over its share of the tokens, reading K rows and writing one, where the ops above write and read back 2K - 1
    [T, D] slices; one worker below :data:`PARALLEL_SUM_K` elements read. The same bits in fp32; in bf16 one
    rounding of the fp32 sum for every K.
    """
    k = rows_of.shape[1]
    if native:  # rows (this module's buffers) and rows_of (the layout's) are contiguous, indices in range
        out = hugepages.advise(rows.new_empty(rows_of.shape[0], rows.shape[1]))
        t = rows_of.shape[0]
        shares = max(1, min(workers_for(rows.device), t)) if rows_of.numel() * rows.shape[1] >= PARALLEL_SUM_K else 1
        if shares == 1:
            cpu_kernels.sum_k(rows, rows_of, out, checked=False)
            return out
        spans = [(t * i // shares, t * (i + 1) // shares) for i in range(shares)]
        run_largest_first(lambda span: cpu_kernels.sum_k(rows, rows_of, out, *span, checked=False), spans,
                          [b - a for a, b in spans])
        return out
    buf = scratch("sum_k", (rows_of.shape[0], rows.shape[1]), rows.dtype, rows.device) if k > 1 else None  # [T, D]

    def gather_add(out: torch.Tensor, j: int) -> torch.Tensor:
        assert buf is not None  # allocated whenever k > 1, the only case with a second row to add
        torch.index_select(rows, 0, rows_of[:, j], out=buf)
        return out.add_(buf)

    if rows.dtype in (torch.float32, torch.float64):
        out = hugepages.advise(rows.new_empty(rows_of.shape[0], rows.shape[1]))  # [T, D]
        torch.index_select(rows, 0, rows_of[:, 0], out=out)
        for j in range(1, k):
            gather_add(out, j)
        return out
    parts: list[torch.Tensor] = []  # pairs first, then a tree over the pair sums
    for j in range(0, k, 2):
        part = rows.index_select(0, rows_of[:, j])
        parts.append(gather_add(part, j + 1) if j + 1 < k else part)
    while len(parts) > 1:
        parts = [parts[i].add_(parts[i + 1]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


# Significant binary digits kept of each expert's row count on the shape-stable path (see padded_rows): at most 8
# row counts per octave, so ~100 GEMM shapes up to 8k rows, and at most 1/8 (on average ~1/16) more rows.
PAD_BITS = 4


def padded_rows(count: int, bits: int = PAD_BITS) -> int:
    """``count`` rounded up to its ``bits`` leading binary digits: a multiple of 2^(bit_length - bits) (no padding
    below 2^bits rows). Adds fewer than count / 2^(bits - 1) rows; the results form a small set of sizes."""
    step = 1 << max(0, count.bit_length() - bits)
    return -(-count // step) * step


def pad_groups(token_ids: torch.Tensor, rows_of: torch.Tensor, topk_ids: torch.Tensor, counts: torch.Tensor,
               bits: int = PAD_BITS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dropless layout with each expert's group padded to :func:`padded_rows` rows.

    Why (docs/performance.md): in bf16 / fp16 PyTorch's CPU GEMM is oneDNN's, which JIT-compiles a kernel for every
    new shape (~8 ms for a GEMM that then runs in ~1 ms), and per-expert row counts change every step. Padded, the
    row counts come from a small set, each compiled once, with one GEMM per expert and projection (a multiple of 64
    plus a remainder would cost a second, badly shaped GEMM: ~280 against ~210 ms at E = 64 in bf16). Rounding
    relative to the count bounds the extra work at any batch size (a fixed 64 would run a 3-row expert as 64).

    A padding row repeats its expert's first token and gets gating weight 0 (the caller scatters the real weights
    into zeros): its pre-activation and outputs are finite whenever the expert's real rows are, its activation
    gradient is exactly zero, so it adds exactly nothing to either weight gradient, and no combine reads it.

    Args:
        token_ids: [N] int64 token of each row (from :func:`route_dropless`).
        rows_of: [T, K] int64 row of each assignment.
        topk_ids: [T, K] int64 expert of each assignment.
        counts: [E] int64 rows per expert.
        bits: leading binary digits kept of each count (>= 1).
    Returns:
        (token_ids [N_pad], rows_of [T, K] into the padded rows, padded counts [E] int64).
    """
    padded = torch.tensor([padded_rows(int(c), bits) for c in counts.tolist()], dtype=counts.dtype,
                          device=counts.device)
    start = torch.cumsum(counts, 0) - counts
    pad_start = torch.cumsum(padded, 0) - padded
    n_pad = int(padded.sum())
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), padded, output_size=n_pad)
    local = torch.arange(n_pad, device=counts.device) - pad_start[expert]
    src = start[expert] + torch.where(local < counts[expert], local, 0)
    return token_ids[src], rows_of + (pad_start - start)[topk_ids], padded


def _shape_stable(x: torch.Tensor) -> bool:
    """Whether GEMM shapes must repeat from step to step (oneDNN's JIT: CPU bf16 / fp16); see :func:`pad_groups`."""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def _blocks(counts: list[int], block_rows: int) -> list[_Block]:
    """Consecutive experts packed into blocks of about ``block_rows`` rows (at least one expert each).

    Returns (first row, rows, [(expert, first row within the block, rows)]) per block, experts with rows only.
    GEMMs run per expert, everything else (gathers, activation, scaling) once per block: at E = 64-128 a per-expert
    elementwise op would cost more in call overhead than in arithmetic.
    """
    blocks: list[_Block] = []
    cur: list[tuple[int, int, int]] = []
    start = cur_rows = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        if cur and cur_rows + n > block_rows:
            blocks.append((start, cur_rows, cur))
            start, cur, cur_rows = start + cur_rows, [], 0
        cur.append((e, cur_rows, n))
        cur_rows += n
    if cur:
        blocks.append((start, cur_rows, cur))
    return blocks


def _run_blocks(fn: Callable[[int, int, list[tuple[int, int, int]], int], None], counts: list[int],
                block_rows: int) -> None:
    """``fn(first row, rows, experts, most)`` for every block (:func:`_blocks`) on the CPU workers
    (moe/kernels/cpu/workers.py), ``most`` being the largest block's rows (every worker's scratch size)."""
    blocks = _blocks(counts, block_rows)
    sizes = [rows for _, rows, _ in blocks]
    most = max(sizes, default=0)
    run_largest_first(lambda block: fn(*block, most), blocks, sizes)


def _activate(h: torch.Tensor, w_rows: torch.Tensor, a: torch.Tensor, activation: str, native: bool) -> None:
    """a [n, F] = activation(h [n, I]) * w_rows [n] (each row's gating weight), written in place."""
    if native:  # one pass (moe/kernels/cpu/native.py)
        cpu_kernels.swiglu_forward(h, w_rows, a, checked=False)  # the caller's own buffers
    else:
        act_forward(h, a, activation)
        a.mul_(w_rows[:, None])


GROUPED_MAX_ROWS = 256
"""Rows up to which one block runs as CPU grouped GEMMs (decode steps); training batches keep the tile loop."""


@functools.cache
def _cpu_grouped_mm() -> bool:
    """Whether this torch runs ``F.grouped_mm`` on the CPU (torch 2.8 has it on CUDA only); probed once."""
    try:
        F.grouped_mm(torch.zeros(1, 4), torch.zeros(1, 4, 4), offs=torch.ones(1, dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _grouped_cpu(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes this layer's CPU operands: fp32 / bf16, row strides of 16-byte multiples
    (D, I, F) and aligned weights, as it requires."""
    size = x.element_size()
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and not any((n * size) % 16 for n in (x.shape[1], w_in.shape[1], w_out.shape[2]))
            and not any(t.data_ptr() % 16 for t in (w_in, w_out)) and _cpu_grouped_mm())


def _forward_tiles(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, token_ids: torch.Tensor,
                   w_rows: torch.Tensor, counts: list[int], activation: str, block_rows: int, native: bool,
                   keep_h: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    n_rows, hidden = token_ids.numel(), x.shape[1]
    ffn = w_out.shape[2]
    # [N, I], saved (unless recomputed in backward)
    h = hugepages.advise(x.new_empty(n_rows, w_in.shape[1])) if keep_h else None
    y = scratch("fwd.y", (n_rows, hidden), x.dtype, x.device)  # [N, D] gated expert outputs, combined in the caller

    w_in_t, w_out_t = w_in.transpose(1, 2), w_out.transpose(1, 2)  # [E, D, I], [E, F, D]: w[e].T of each expert
    if n_rows <= min(block_rows, GROUPED_MAX_ROWS) and _grouped_cpu(x, w_in, w_out):
        # A few rows in one block (a decode step): each projection as one grouped GEMM, which runs the loop's
        # per-expert ``mm`` calls inside (the same products, bit for bit) without Python between them.
        offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)
        hg = F.grouped_mm(x.index_select(0, token_ids), w_in_t, offs=offs)  # [N, I]
        a = scratch("fwd.a", (n_rows, ffn), x.dtype, x.device)  # [N, F]
        _activate(hg, w_rows, a, activation, native)
        return F.grouped_mm(a, w_out_t, offs=offs), (hg if keep_h else None)

    def run(s: int, n: int, experts: list[tuple[int, int, int]], most: int) -> None:
        # one block, with the worker's own scratch buffers (workspace.py: per thread)
        xs = scratch("fwd.xs", (most, hidden), x.dtype, x.device)  # [n, D] this block's input rows
        a = scratch("fwd.a", (most, ffn), x.dtype, x.device)  # [n, F] their activation
        # [n, I]; h is None when not keep_h
        hb = h[s : s + n] if h is not None else scratch("fwd.h", (most, w_in.shape[1]), x.dtype, x.device)[:n]
        torch.index_select(x, 0, token_ids[s : s + n], out=xs[:n])
        for e, r, m in experts:
            torch.mm(xs[r : r + m], w_in_t[e], out=hb[r : r + m])
        _activate(hb, w_rows[s : s + n], a[:n], activation, native)
        for e, r, m in experts:
            torch.mm(a[r : r + m], w_out_t[e], out=y[s + r : s + r + m])

    _run_blocks(run, counts, block_rows)
    return y, h


def _backward_tiles(dout: torch.Tensor, x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                    h: torch.Tensor | None, token_ids: torch.Tensor, w_rows: torch.Tensor, counts: list[int],
                    activation: str, needs: _Needs, block_rows: int, native: bool) -> _RowGrads:
    need_x, need_w, need_in, need_out = needs
    n_rows, hidden = token_ids.numel(), x.shape[1]
    ffn = w_out.shape[2]
    dx_rows = scratch("bwd.dx", (n_rows, hidden), x.dtype, x.device) if need_x else None  # [N, D], combined by caller
    acc = torch.promote_types(x.dtype, torch.float32)
    dw_rows = torch.empty(n_rows, dtype=acc, device=x.device) if need_w else None  # [N]
    d_in = hugepages.advise(torch.empty_like(w_in)) if need_in else None
    d_out = hugepages.advise(torch.empty_like(w_out)) if need_out else None
    for e, count in enumerate(counts):
        if count == 0:  # took no part in the output: exact zeros
            for grad in (d_in, d_out):
                if grad is not None:
                    grad[e].zero_()

    # Each optional buffer below is None exactly when its need_* flag (or recompute: h None) says it is not used.
    def run(s: int, n: int, experts: list[tuple[int, int, int]], most: int) -> None:
        # one block, with the worker's own scratch buffers (workspace.py: per thread)
        def buf(name: str, width: int) -> torch.Tensor:
            return scratch("bwd." + name, (most, width), x.dtype, x.device)

        g = buf("g", hidden)  # [n, D] dL/dy for this block's rows
        xs = buf("xs", hidden) if need_in or h is None else None  # [n, D] their input rows, gathered again
        hs = buf("h", w_in.shape[1]) if h is None else None  # [n, I] recomputed pre-activation
        dz = buf("dz", ffn)  # [n, F] dL/d(w a), then dL/da
        a = buf("a", ffn) if need_out or (need_w and not native) else None  # [n, F] recomputed activation
        sg = buf("sg", ffn) if activation == "swiglu" and not native else None  # [n, F] silu(gate)
        prod = buf("prod", ffn) if need_w and not native else None  # [n, F] dz * a, summed over F
        dh = buf("dh", w_in.shape[1])  # [n, I] dL/dh
        we = w_rows[s : s + n, None]
        if h is None:  # recompute: gather the rows again and rerun the input projection
            assert hs is not None and xs is not None
            he = hs[:n]
            torch.index_select(x, 0, token_ids[s : s + n], out=xs[:n])
            for e, r, m in experts:
                torch.mm(xs[r : r + m], w_in[e].T, out=he[r : r + m])
        else:
            he = h[s : s + n]
        torch.index_select(dout, 0, token_ids[s : s + n], out=g[:n])
        for e, r, m in experts:
            torch.mm(g[r : r + m], w_out[e], out=dz[r : r + m])
        if native:  # one pass (moe/kernels/cpu/native.py): w * a, dL/dh and dL/dw
            # native: a is allocated iff need_out, dw_rows iff need_w
            cpu_kernels.swiglu_backward(he, dz[:n], w_rows[s : s + n], a[:n] if a is not None else None, dh[:n],
                                        dw_rows[s : s + n] if dw_rows is not None else None)
        else:
            act_recompute(he, a[:n] if a is not None else None, sg[:n] if sg is not None else None, activation)
            if need_w:
                assert a is not None and prod is not None and dw_rows is not None
                torch.mul(dz[:n], a[:n], out=prod[:n])
                torch.sum(prod[:n], dim=1, dtype=acc, out=dw_rows[s : s + n])
            if need_out:
                assert a is not None
                a[:n].mul_(we)
        if need_out:
            assert a is not None and d_out is not None
            for e, r, m in experts:
                torch.mm(g[r : r + m].T, a[r : r + m], out=d_out[e])
        if not native:
            dz[:n].mul_(we)
            act_grad(dz[:n], he, dh[:n], sg[:n] if sg is not None else None, activation)
        if need_x:
            assert dx_rows is not None
            for e, r, m in experts:
                torch.mm(dh[r : r + m], w_in[e], out=dx_rows[s + r : s + r + m])
        if need_in:
            assert xs is not None and d_in is not None
            if h is not None:
                torch.index_select(x, 0, token_ids[s : s + n], out=xs[:n])
            for e, r, m in experts:
                torch.mm(dh[r : r + m].T, xs[r : r + m], out=d_in[e])

    _run_blocks(run, counts, block_rows)
    return dx_rows, dw_rows, d_in, d_out


def _forward_grouped(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, token_ids: torch.Tensor,
                     w_rows: torch.Tensor, offs: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    x_rows = x.index_select(0, token_ids)  # [N, D]
    h = F.grouped_mm(x_rows, w_in.transpose(-2, -1), offs=offs)  # [N, I]
    a = x.new_empty(h.shape[0], w_out.shape[2])
    act_forward(h, a, activation)
    a.mul_(w_rows[:, None])
    return F.grouped_mm(a, w_out.transpose(-2, -1), offs=offs), h  # [N, D]


def _backward_grouped(dout: torch.Tensor, x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                      h: torch.Tensor | None, token_ids: torch.Tensor, w_rows: torch.Tensor, offs: torch.Tensor,
                      activation: str, needs: _Needs) -> _RowGrads:
    need_x, need_w, need_in, need_out = needs
    counts = torch.diff(offs, prepend=offs.new_zeros(1))  # [E] rows per expert, for the idle experts' exact zeros
    if h is None:  # recompute the pre-activation (one more grouped GEMM)
        h = F.grouped_mm(x.index_select(0, token_ids), w_in.transpose(-2, -1), offs=offs)
    g = dout.index_select(0, token_ids)  # [N, D]
    dz = F.grouped_mm(g, w_out, offs=offs)  # [N, F]
    a = torch.empty_like(dz) if need_w or need_out else None
    sg = torch.empty_like(dz) if activation == "swiglu" else None
    act_recompute(h, a, sg, activation)
    dx_rows: torch.Tensor | None = None
    dw_rows: torch.Tensor | None = None
    d_in: torch.Tensor | None = None
    d_out: torch.Tensor | None = None
    if need_w:
        assert a is not None
        dw_rows = (dz * a).sum(dim=1, dtype=torch.promote_types(x.dtype, torch.float32))
    if need_out:
        assert a is not None
        a.mul_(w_rows[:, None])
        d_out = zero_idle(F.grouped_mm(g.T, a, offs=offs), counts)  # [E, D, F]
    dz.mul_(w_rows[:, None])
    dh = torch.empty_like(h)
    act_grad(dz, h, dh, sg, activation)
    if need_x:
        dx_rows = F.grouped_mm(dh, w_in, offs=offs)  # [N, D]
    if need_in:
        d_in = zero_idle(F.grouped_mm(dh.T, x.index_select(0, token_ids), offs=offs), counts)  # [E, I, D]
    return dx_rows, dw_rows, d_in, d_out


def _forward(x: torch.Tensor, weights: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, token_ids: torch.Tensor,
             rows_of: torch.Tensor, groups: list[int] | torch.Tensor, activation: str, block_rows: int, keep_h: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool, bool]:
    """The forward of :class:`_FusedMoE`: (combined output [T, D], ``h`` [N, I] or ``None`` unless ``keep_h``,
    gating weight of each row [N] in x's dtype, native activation kernels used, native combine used)."""
    w_rows = torch.zeros(token_ids.numel(), dtype=weights.dtype, device=x.device)
    w_rows.scatter_(0, rows_of.reshape(-1), weights.reshape(-1))  # [N] gating weight of each row (0: padding)
    w_rows_c = w_rows.to(x.dtype)
    if isinstance(groups, list):
        # moe/kernels/cpu/native.py: the activation's kernels, the combine's
        native, native_sum = cpu_kernels.supports(x, activation), cpu_kernels.supports(x)
        y, h = _forward_tiles(x, w_in, w_out, token_ids, w_rows_c, groups, activation, block_rows, native, keep_h)
        return _sum_k(y, rows_of, native_sum), h, w_rows_c, native, native_sum
    y, h_all = _forward_grouped(x, w_in, w_out, token_ids, w_rows_c, groups, activation)
    return _sum_k(y, rows_of), h_all if keep_h else None, w_rows_c, False, False


class _FusedMoE(torch.autograd.Function):
    """out = sum_k w_k * expert_k(x); ``groups`` is a list of host counts (tiles) or device offsets (grouped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor, w_in: torch.Tensor,  # noqa: D102
                w_out: torch.Tensor, token_ids: torch.Tensor, rows_of: torch.Tensor, groups: list[int] | torch.Tensor,
                activation: str, block_rows: int, recompute: bool) -> torch.Tensor:
        out, h, w_rows_c, ctx.native, ctx.native_sum = _forward(x, weights, w_in, w_out, token_ids, rows_of, groups,
                                                                activation, block_rows, keep_h=not recompute)
        ctx.counts = groups if isinstance(groups, list) else None
        offs = [] if isinstance(groups, list) else [groups]
        ctx.save_for_backward(x, w_in, w_out, h, token_ids, rows_of, w_rows_c, *offs)
        ctx.activation = activation
        ctx.block_rows = block_rows
        ctx.weights_dtype = weights.dtype
        return out

    @staticmethod
    @once_differentiable  # written with out= kernels: a second derivative raises instead of being silently wrong
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[  # noqa: D102
            torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
            None, None, None, None, None, None]:
        needs = tuple(ctx.needs_input_grad[:4])
        dout = dout.contiguous()
        x, w_in, w_out, h, token_ids, rows_of, w_rows, *offs = ctx.saved_tensors
        if ctx.counts is not None:
            dx_rows, dw_rows, d_in, d_out = _backward_tiles(dout, x, w_in, w_out, h, token_ids, w_rows, ctx.counts,
                                                            ctx.activation, needs, ctx.block_rows, ctx.native)
        else:
            dx_rows, dw_rows, d_in, d_out = _backward_grouped(dout, x, w_in, w_out, h, token_ids, w_rows, offs[0],
                                                              ctx.activation, needs)
        dx = _sum_k(dx_rows, rows_of, ctx.native_sum) if dx_rows is not None else None
        dw = None
        if dw_rows is not None:
            dw = dw_rows.index_select(0, rows_of.reshape(-1)).view(rows_of.shape).to(ctx.weights_dtype)
        return dx, dw, d_in, d_out, None, None, None, None, None, None


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    activation: str = "swiglu",
    *,
    mode: str = "auto",
    block_rows: int | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """Dropless routed-expert FFN of one MoE layer, fused (see the module docstring).

    Args:
        x: [T, D] tokens.
        topk_ids: [T, K] int64 experts of each token (distinct per token).
        topk_weights: [T, K] fp32 gating weights (differentiable).
        w_in: [E, 2F, D] (swiglu, gate half first) or [E, F, D] (gelu).
        w_out: [E, D, F].
        activation: ``swiglu`` or ``gelu``.
        mode: ``tiles`` (per-expert ``torch.mm``; reads the counts on the host), ``grouped`` (one ``grouped_mm``
            per projection, no host sync; needs 16-byte aligned rows) or ``auto`` (grouped on CUDA in bf16, else
            tiles).
        block_rows: tiles mode: consecutive experts are packed into blocks of about this many rows for the
            non-GEMM work (see :func:`_blocks`); ``None``: :data:`BLOCK_ELEMENTS` / max(I, D), with several CPU
            workers at most about N / (:data:`BLOCKS_PER_WORKER` x workers) but not below :data:`MIN_BLOCK_ROWS`.
        recompute: save nothing of the experts' own for backward (not even ``h`` [N, I]): backward gathers each
            block's rows again and reruns the input projection (Megatron-Core's ``--recompute-modules moe``
            trade, for the experts: +1 GEMM of 2 N D I FLOPs; saves N I elements).
    Returns:
        [T, D] in the compute dtype (the autocast dtype under autocast, else the weights' dtype).
    Raises:
        ValueError: unknown mode or activation, or mismatched shapes.
    """
    x, w_in, w_out, mode = _prepare(
        mode, activation, x, w_in, w_out,
        topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0],
        f"fused_moe: shapes do not match: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, "
        f"topk_weights {tuple(topk_weights.shape)}, w_in {tuple(w_in.shape)}, w_out {tuple(w_out.shape)}")
    token_ids, rows_of, counts = route_dropless(topk_ids, w_in.shape[0])
    return _launch(x, topk_weights, w_in, w_out, (token_ids, rows_of, topk_ids, counts), activation, mode, block_rows,
                   recompute)


def _prepare(mode: str, activation: str, x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, routing_ok: bool,
             message: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Operands in the compute dtype (x contiguous) and the mode ``auto`` resolves to (grouped on CUDA in bf16 with
    16-byte aligned rows, else tiles); ValueError (``message`` for the shapes) for an unknown mode or activation, or
    operand shapes that do not fit together."""
    if mode not in MODES:
        raise ValueError(f"mode: unknown mode {mode!r}; choose one of {list(MODES)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: unknown activation {activation!r}; choose one of {list(ACTIVATIONS)}")
    e, width, hidden = w_in.shape
    ffn = w_out.shape[2]
    if (not routing_ok or x.dim() != 2 or x.shape[1] != hidden or w_out.shape != (e, hidden, ffn)
            or width != (2 * ffn if activation == "swiglu" else ffn)):
        raise ValueError(message)
    dtype = compute_dtype(x, w_in)
    if x.dtype != dtype or w_in.dtype != dtype or w_out.dtype != dtype:  # compared first: a decode step's no-op
        x, w_in, w_out = x.to(dtype), w_in.to(dtype), w_out.to(dtype)  # .to calls cost more than its kernels
    x = x.contiguous()
    if mode == "auto":
        grouped = x.dtype == torch.bfloat16 and grouped_mm_aligned(x.dtype, x.shape[1], w_in.shape[1], w_out.shape[2])
        mode = "grouped" if x.device.type == "cuda" and grouped else "tiles"
    return x, w_in, w_out, mode


def _launch(x: torch.Tensor, weights: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
            layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], activation: str, mode: str,
            block_rows: int | None, recompute: bool) -> torch.Tensor:
    """Shared tail of :func:`fused_moe` and :func:`fused_experts`: pads the groups where GEMM shapes must repeat
    (:func:`pad_groups`), sizes the blocks and applies the Function. ``layout`` is (token_ids [N], rows_of [T, K],
    topk_ids [T, K], counts [E]) as :func:`~moetrain.moe.dispatch.route_dropless` returns them."""
    token_ids, rows_of, topk_ids, counts = layout
    if mode == "tiles" and _shape_stable(x):
        token_ids, rows_of, counts = pad_groups(token_ids, rows_of, topk_ids, counts)
    groups: torch.Tensor | list[int] = (torch.cumsum(counts, 0).to(torch.int32) if mode == "grouped"
                                        else [int(c) for c in counts.tolist()])
    if block_rows is None:
        block_rows = BLOCK_ELEMENTS // max(w_in.shape[1], x.shape[1])
        workers = workers_for(x.device) if isinstance(groups, list) else 1
        # a few blocks per worker, so that the largest-first queue evens out the workers' loads
        if workers > 1 and isinstance(groups, list):
            per_block = -(-sum(groups) // (BLOCKS_PER_WORKER * workers))
            block_rows = min(block_rows, max(MIN_BLOCK_ROWS, per_block))
    if not torch.is_grad_enabled():  # nothing to differentiate (generation, serving): without the Function's
        return _forward(x, weights, w_in, w_out, token_ids, rows_of, groups, activation, max(1, block_rows),
                        keep_h=False)[0]  # bookkeeping, nor the pre-activation it would save
    out = _FusedMoE.apply(x, weights, w_in, w_out, token_ids, rows_of, groups,  # type: ignore[no-untyped-call]
                          activation, max(1, block_rows), recompute)  # Function.apply is untyped in torch's stubs
    return cast(torch.Tensor, out)


def fused_experts(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, tokens_per_expert: torch.Tensor,
                  activation: str = "swiglu", *, mode: str = "auto", block_rows: int | None = None,
                  recompute: bool = False) -> torch.Tensor:
    """Routed experts alone, on rows a dispatcher laid out (a capacity factor, expert parallelism): the Function of
    :func:`fused_moe`, each row routed to its own expert with weight 1; the backend signature of
    :func:`moetrain.moe.experts.loop_experts`, the reference it is tested against (tests/test_perf_experts.py).

    Args:
        x: [R, D] rows grouped by expert (expert 0's rows first); rows past the last group are ignored (their
            output is zero in tiles mode, unspecified in grouped mode).
        w_in: [E, 2F, D] (swiglu, gate half first) or [E, F, D] (gelu).
        w_out: [E, D, F].
        tokens_per_expert: [E] int rows per expert (sum <= R; zeros allowed).
        activation: ``swiglu`` or ``gelu``.
        mode: as :func:`fused_moe`.
        block_rows: as :func:`fused_moe`.
        recompute: as :func:`fused_moe`.
    Returns:
        [R, D] in the compute dtype (the autocast dtype under autocast, else the weights' dtype).
    Raises:
        ValueError: unknown mode or activation, mismatched shapes, or counts that exceed the rows.
    """
    x, w_in, w_out, mode = _prepare(mode, activation, x, w_in, w_out, tokens_per_expert.shape == (w_in.shape[0],),
                                    f"fused experts: shapes do not match: x {tuple(x.shape)}, w_in "
                                    f"{tuple(w_in.shape)}, w_out {tuple(w_out.shape)}, tokens_per_expert "
                                    f"{tuple(tokens_per_expert.shape)}")
    rows = x.shape[0]
    if mode == "tiles":  # the counts are read on the host anyway: compute the grouped rows only
        used = int(tokens_per_expert.sum())
        if used > rows:
            raise ValueError(f"tokens_per_expert: counts sum to {used}, x has only {rows} rows")
        x = x[:used]
    ids = torch.arange(x.shape[0], device=x.device)
    expert_of = torch.repeat_interleave(torch.arange(w_in.shape[0], device=x.device), tokens_per_expert,
                                        output_size=x.shape[0]) if mode == "tiles" else ids  # unused when grouped
    ones = torch.ones(x.shape[0], 1, device=x.device)  # [R, 1] fp32 weight 1 per row: w * a is exact
    y = _launch(x, ones, w_in, w_out, (ids, ids[:, None], expert_of[:, None], tokens_per_expert), activation, mode,
                block_rows, recompute)
    return F.pad(y, (0, 0, 0, rows - y.shape[0]))  # rows past the last group: zeros


class FusedLocalDispatcher(LocalDispatcher):
    """The layer's single-device dispatcher for a backend with a fused form (``fused``): :meth:`forward` hands the
    tokens and their routing to the experts module, whose backend runs dispatch, experts and combine as one
    Function (:func:`fused_moe`); ``dispatch`` / ``combine`` are :class:`~moetrain.moe.dispatch.LocalDispatcher`'s,
    for the capacity layouts (the experts then run :func:`fused_experts`).
    """

    fuses_experts = True

    def forward(self, tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: RoutedExperts) -> torch.Tensor:
        """Dropless dispatch -> experts -> combine in one step, through ``experts``' own forward (so checkpointing
        the experts module recomputes it).

        Args:
            tokens: [T, D].  topk_ids: [T, K] int64.  topk_weights: [T, K] fp32 (differentiable).
            experts: the layer's routed experts.
        Returns:
            [T, D] in the compute dtype (the caller casts it back to the tokens' dtype).
        """
        return cast(torch.Tensor, experts(tokens, topk_ids=topk_ids, topk_weights=topk_weights))
