"""Fast routed experts (backend ``fused``): one autograd Function with a hand-written backward.

Legend: R = dispatched rows (grouped by expert), D = hidden, E = experts, F = expert FFN hidden, I = input-projection
width (2F for SwiGLU, F for GELU), n = rows of one tile (a slice of one expert's group).

Same maths, weight layout and backend signature as :func:`moetrain.moe.experts.loop_experts` (SwiGLU:
``down_e(silu(gate_e x) * up_e x)`` with ``gate_up_proj`` [E, 2F, D], gate half first; GELU: ``down_e(gelu(up_e x))``
with the exact erf GELU; ``down_proj`` [E, D, F]); what changes is the execution:

- **Saved tensors.** Forward saves only ``x`` and the pre-activation ``h`` ([R, D] + [R, I]). The activation
  ``a`` is recomputed in backward (cheap elementwise work) instead of being stored: autograd keeps ``a`` and, for
  SwiGLU, ``silu(gate)`` too, 2F more values per row.
- **Activation backward by hand** (``aten.silu_backward`` / ``aten.gelu_backward``), with the gradients of gate and
  up written straight into the one buffer the next GEMM reads (no ``torch.cat`` of the halves, no temporaries).
- **CPU: per-expert GEMMs into preallocated outputs.** Each expert's rows run as ``torch.mm`` calls into slices of
  outputs allocated once (in tiles of at most ``tile_rows`` rows, which bounds the scratch buffers), and the
  elementwise work on a tile runs right after the GEMM that produced it; scratch buffers are allocated once per
  call and reused (a fresh multi-MiB tensor per op costs page faults on CPU), and the large outputs ask for 2 MiB
  pages (moe/kernels/cpu/hugepages.py). The counts are read on the host once (free on CPU). Autograd around stock
  ``grouped_mm`` instead streams [R, I] intermediates through fresh memory between every op.
- **GPU: grouped GEMM.** On CUDA in bf16 the same Function runs each GEMM as one
  ``torch.nn.functional.grouped_mm`` (the forward and the exact backward calls of torch's own ``grouped_mm``
  derivative: ragged-M for activations, ragged-K for weight gradients) with device offsets, so there is no host
  sync and one launch per projection; ``mode="grouped"`` runs that path on CPU too, which is how it is tested
  here (tests/test_perf_experts.py). Other dtypes on CUDA use the tiled path.

The per-expert loop (:func:`moetrain.moe.experts.loop_experts`) stays the reference; tests/test_perf_experts.py
proves equal outputs and gradients (x, both weights) in fp32 and bf16, including experts with zero rows and rows
past the last group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moetrain.moe.kernels.cpu import hugepages

_silu_out = torch.ops.aten.silu.out
_silu_backward_out = torch.ops.aten.silu_backward.grad_input
_gelu_out = torch.ops.aten.gelu.out
_gelu_backward_out = torch.ops.aten.gelu_backward.grad_input

# Rows per CPU tile. Measured on a 2-core Sapphire Rapids: 256-row tiles (L2-sized at F = 1024) lose more GEMM
# efficiency than they gain in cache hits, most in bf16, where oneDNN packs the weight on every call; 1024 rows
# and whole experts time the same. The bound keeps the scratch buffers small when one expert gets many rows.
DEFAULT_TILE_ROWS = 2048
# Rows of the shape-stable part of an expert's GEMMs (tile_rows must be a multiple; see _tiles).
ROW_QUANTUM = 64
MODES = ("auto", "tiles", "grouped")


def _act_forward(h: torch.Tensor, a: torch.Tensor, activation: str) -> None:
    """a = silu(gate) * up (h = [gate | up]) or gelu(h); writes a in place. h: [n, I], a: [n, F]."""
    if activation == "swiglu":
        ffn = a.shape[1]
        _silu_out(h[:, :ffn], out=a)
        a.mul_(h[:, ffn:])
    else:
        _gelu_out(h, out=a)


def _act_recompute(h: torch.Tensor, a: torch.Tensor | None, sg: torch.Tensor | None, activation: str) -> None:
    """Backward's recomputation from h [n, I]: sg = silu(gate) [n, F] (SwiGLU), and, when ``a`` [n, F] is given,
    the activation itself (silu(gate) * up from the same sg, or gelu(h))."""
    if activation == "swiglu":
        ffn = sg.shape[1]
        _silu_out(h[:, :ffn], out=sg)
        if a is not None:
            torch.mul(sg, h[:, ffn:], out=a)
    elif a is not None:
        _gelu_out(h, out=a)


def _act_grad(da: torch.Tensor, h: torch.Tensor, dh: torch.Tensor, sg: torch.Tensor | None, activation: str) -> None:
    """dh [n, I] = d/dh of the activation applied to da [n, F] (overwritten); sg = silu(gate) from
    :func:`_act_recompute` (SwiGLU only)."""
    if activation == "swiglu":
        ffn = da.shape[1]
        gate, up = h[:, :ffn], h[:, ffn:]
        # a = silu(g) * u  =>  du = da * silu(g),  dg = silu'(g) * (da * u)
        torch.mul(da, sg, out=dh[:, ffn:])
        da.mul_(up)
        _silu_backward_out(da, gate, grad_input=dh[:, :ffn])
    else:
        _gelu_backward_out(da, h, grad_input=dh)


def _act_backward(da: torch.Tensor, h: torch.Tensor, dh: torch.Tensor, activation: str,
                  a: torch.Tensor | None, sg: torch.Tensor | None) -> None:
    """:func:`_act_recompute` (into ``a`` when given) then :func:`_act_grad`."""
    _act_recompute(h, a, sg, activation)
    _act_grad(da, h, dh, sg, activation)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on (as moe/experts.py: the GEMMs here have no autocast rule), else the
    weight's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def _tiles(counts: list[int], tile_rows: int) -> list[tuple[int, int, int, bool]]:
    """(expert, first row, rows, first tile of its expert) of every non-empty tile, in row order.

    An expert's last, partial tile is cut into a multiple of :data:`ROW_QUANTUM` rows and a remainder, so that the
    GEMM shapes repeat from step to step (oneDNN, PyTorch's CPU bf16 GEMM, compiles a kernel per new shape: see
    moe/fast_moe.py ``pad_groups``, which pads instead; here the rows come laid out by the dispatcher).
    """
    out = []
    start = 0
    for e, n in enumerate(counts):
        off = 0
        while off < n:
            rows = min(tile_rows, n - off)
            if rows < tile_rows and rows > ROW_QUANTUM and rows % ROW_QUANTUM:
                rows -= rows % ROW_QUANTUM
            out.append((e, start + off, rows, off == 0))
            off += rows
        start += n
    return out


def _forward_tiles(x, w_in, w_out, counts, activation, tile_rows):
    r, hidden = x.shape
    ffn = w_out.shape[2]
    h = hugepages.advise(x.new_empty(r, w_in.shape[1]))  # [R, I], saved
    y = hugepages.advise(x.new_empty(r, hidden))  # [R, D]
    a = x.new_empty(min(tile_rows, max(r, 1)), ffn)  # [n, F] scratch
    used = sum(counts)
    for e, s, n, _ in _tiles(counts, tile_rows):
        he = h[s : s + n]
        torch.mm(x[s : s + n], w_in[e].T, out=he)
        _act_forward(he, a[:n], activation)
        torch.mm(a[:n], w_out[e].T, out=y[s : s + n])
    y[used:].zero_()  # rows past the last group: defined (zero) rather than uninitialised memory
    h[used:].zero_()
    return y, h


def _backward_tiles(dy, x, w_in, w_out, h, counts, activation, tile_rows, needs):
    r, hidden = x.shape
    ffn = w_out.shape[2]
    need_x, need_in, need_out = needs
    tile = min(tile_rows, max(r, 1))
    dx = hugepages.advise(x.new_empty(r, hidden)) if need_x else None
    if dx is not None and sum(counts) < r:
        dx.zero_()
    d_in = hugepages.advise(torch.empty_like(w_in)) if need_in else None
    d_out = hugepages.advise(torch.empty_like(w_out)) if need_out else None
    # An expert with no rows took no part in the output: exact zeros. The others are written by their first tile
    # (beta = 0 ignores the uninitialised memory, NaN included) and accumulated by the rest.
    for e, count in enumerate(counts):
        if count == 0:
            for grad in (d_in, d_out):
                if grad is not None:
                    grad[e].zero_()
    a = x.new_empty(tile, ffn)  # [n, F] recomputed activation
    sg = x.new_empty(tile, ffn) if activation == "swiglu" else None  # [n, F] silu(gate)
    da = x.new_empty(tile, ffn)  # [n, F] dL/da
    dh = x.new_empty(tile, w_in.shape[1])  # [n, I] dL/dh
    for e, s, n, first in _tiles(counts, tile_rows):
        he, dye = h[s : s + n], dy[s : s + n]
        beta = 0 if first else 1
        # The down projection's input gradient first: the activation backward then also recomputes a.
        torch.mm(dye, w_out[e], out=da[:n])
        _act_backward(da[:n], he, dh[:n], activation, a[:n] if need_out else None,
                      sg[:n] if sg is not None else None)
        if need_out:
            d_out[e].addmm_(dye.T, a[:n], beta=beta)
        if need_x:
            torch.mm(dh[:n], w_in[e], out=dx[s : s + n])
        if need_in:
            d_in[e].addmm_(dh[:n].T, x[s : s + n], beta=beta)
    return dx, d_in, d_out


def _activation(h: torch.Tensor, ffn: int, activation: str) -> torch.Tensor:
    a = h.new_empty(h.shape[0], ffn)
    _act_forward(h, a, activation)
    return a


def _zero_idle(grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Exact zeros for experts with no rows (a ragged-K grouped GEMM need not write them), no host sync."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.where((counts > 0).view(-1, 1, 1), grad, 0)


def _forward_grouped(x, w_in, w_out, offs, activation):
    h = F.grouped_mm(x, w_in.transpose(-2, -1), offs=offs)  # [R, I]
    a = _activation(h, w_out.shape[2], activation)  # [R, F]
    y = F.grouped_mm(a, w_out.transpose(-2, -1), offs=offs)  # [R, D]; rows past offs[-1] unspecified
    return y, h


def _backward_grouped(dy, x, w_in, w_out, h, offs, activation, needs):
    need_x, need_in, need_out = needs
    da = F.grouped_mm(dy, w_out, offs=offs)  # [R, F]
    a = torch.empty_like(da) if need_out else None
    sg = torch.empty_like(da) if activation == "swiglu" else None
    dh = torch.empty_like(h)
    _act_backward(da, h, dh, activation, a, sg)
    dx = d_in = d_out = None
    if need_out:
        d_out = _zero_idle(F.grouped_mm(dy.T, a, offs=offs), offs)  # [E, D, F]
    if need_x:
        dx = F.grouped_mm(dh, w_in, offs=offs)  # [R, D]
    if need_in:
        d_in = _zero_idle(F.grouped_mm(dh.T, x, offs=offs), offs)  # [E, I, D]
    return dx, d_in, d_out


class _FusedExperts(torch.autograd.Function):
    """Experts forward and hand-written backward; ``groups`` is a list of host counts (tiles) or device offsets
    (grouped)."""

    @staticmethod
    def forward(ctx, x, w_in, w_out, groups, activation, tile_rows):  # noqa: D102
        if isinstance(groups, list):
            y, h = _forward_tiles(x, w_in, w_out, groups, activation, tile_rows)
            ctx.save_for_backward(x, w_in, w_out, h)
        else:
            y, h = _forward_grouped(x, w_in, w_out, groups, activation)
            ctx.save_for_backward(x, w_in, w_out, h, groups)
        ctx.groups = groups if isinstance(groups, list) else None
        ctx.activation = activation
        ctx.tile_rows = tile_rows
        return y

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable: raise rather than be wrong
    def backward(ctx, dy):  # noqa: D102
        needs = tuple(ctx.needs_input_grad[:3])
        dy = dy.contiguous()
        if ctx.groups is not None:
            x, w_in, w_out, h = ctx.saved_tensors
            grads = _backward_tiles(dy, x, w_in, w_out, h, ctx.groups, ctx.activation, ctx.tile_rows, needs)
        else:
            x, w_in, w_out, h, offs = ctx.saved_tensors
            grads = _backward_grouped(dy, x, w_in, w_out, h, offs, ctx.activation, needs)
        return (*grads, None, None, None)


def _grouped_ok(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
    """Whether CUDA's grouped GEMM takes these operands: bf16 and 16-byte aligned rows."""
    return (x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")
            and all(d % 8 == 0 for d in (x.shape[1], w_in.shape[1], w_out.shape[2])))


def fused_experts(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    activation: str = "swiglu",
    *,
    mode: str = "auto",
    tile_rows: int = DEFAULT_TILE_ROWS,
) -> torch.Tensor:
    """Dropless routed experts with a hand-written backward (the ``fused`` backend; see the module docstring).

    Args:
        x: [R, D] rows grouped by expert (expert 0's rows first); rows past the last group are ignored (their
            output is zero on the tiled path, unspecified on the grouped one).
        w_in: [E, 2F, D] (swiglu, gate half first) or [E, F, D] (gelu).
        w_out: [E, D, F].
        tokens_per_expert: [E] int rows per expert (sum <= R; zeros allowed).
        activation: ``swiglu`` or ``gelu``.
        mode: ``tiles`` (per-expert ``torch.mm`` tiles; reads the counts on the host), ``grouped`` (one
            ``grouped_mm`` per projection, no host sync; needs 16-byte aligned rows), or ``auto`` (grouped on CUDA
            in bf16, tiles otherwise).
        tile_rows: most rows per tile (tiles mode).
    Returns:
        [R, D] in the compute dtype (the autocast dtype under autocast, else the weights' dtype).
    Raises:
        ValueError: unknown mode or activation, mismatched shapes, or counts that exceed the rows.
    """
    if mode not in MODES:
        raise ValueError(f"mode: unknown experts mode {mode!r}; choose one of {list(MODES)}")
    if activation not in ("swiglu", "gelu"):
        raise ValueError(f"activation: unknown activation {activation!r}; choose 'swiglu' or 'gelu'")
    e, width, hidden = w_in.shape
    ffn = w_out.shape[2]
    if tokens_per_expert.shape != (e,) or x.shape[1] != hidden or w_out.shape != (e, hidden, ffn) or (
            width != (2 * ffn if activation == "swiglu" else ffn)):
        raise ValueError(f"fused experts: shapes do not match: x {tuple(x.shape)}, w_in {tuple(w_in.shape)}, "
                         f"w_out {tuple(w_out.shape)}, tokens_per_expert {tuple(tokens_per_expert.shape)}")
    dtype = _compute_dtype(x, w_in)
    x, w_in, w_out = x.to(dtype).contiguous(), w_in.to(dtype), w_out.to(dtype)
    if mode == "auto":
        mode = "grouped" if x.device.type == "cuda" and _grouped_ok(x, w_in, w_out) else "tiles"
    if mode == "grouped":
        groups = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)  # [E] end offset of each group
    else:
        groups = [int(c) for c in tokens_per_expert.tolist()]
        if sum(groups) > x.shape[0]:
            raise ValueError(f"tokens_per_expert: counts sum to {sum(groups)}, x has only {x.shape[0]} rows")
    return _FusedExperts.apply(x, w_in, w_out, groups, activation, max(1, int(tile_rows)))
