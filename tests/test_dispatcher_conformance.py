"""One conformance suite for every :class:`~moetrain.moe.dispatcher.Dispatcher` (issue 16).

Each dispatcher (local sort-based, fused local, all-to-all and all-gather over a one-rank gloo group in a forked
process, as tests/_parallel_util.py runs the parallel tests) moves tokens for routed experts and is checked against
a plain per-expert loop written here (every expert's tokens found by ``nonzero``, two dense matmuls, the gating
weight multiplied in, outputs added back with ``index_add``): the output, and the gradients of the input, the router
weight (through the top-k gating weights) and both expert weights, in fp64 (to 1e-12) and fp32; dropless, dropping
(``keep``) and the capacity layout (``capacity``, C rows per expert, empty slots exact zeros) for every dispatcher
that declares ``supports_capacity``, and a clear error for one that does not.

Legend: T = tokens, D = hidden, E = experts, K = top-k, F = expert FFN hidden, C = capacity.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _parallel_util import spawn
from moetrain.errors import ConfigError
from moetrain.execution import ExecutionConfig
from moetrain.moe.capacity import capacity_keep
from moetrain.moe.config import CapacityConfig, ExpertsConfig, MoEConfig
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.dispatcher import Dispatcher
from moetrain.moe.experts import RoutedExperts
from moetrain.moe.fast_moe import FusedLocalDispatcher
from moetrain.moe.layer import MoELayer
from moetrain.parallel.all_gather import AllGatherDispatcher
from moetrain.parallel.all_to_all import AllToAllDispatcher

T, D, E, K, F_HIDDEN, C = 24, 12, 6, 2, 10, 5  # C = 5 < T * K / E = 8: the capacity drops assignments
NAMES = ("local", "fused_local", "all_to_all", "all_gather")
CASES = ("dropless", "drop", "capacity_layout")
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
ACTIVATIONS = ("swiglu", "gelu")


def _inputs(activation: str, dtype: torch.dtype, seed: int = 0):
    """Tokens, router weight, expert weights and the upstream gradient (same on every call with the same seed)."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * F_HIDDEN if activation == "swiglu" else F_HIDDEN
    x = torch.randn(T, D, generator=g)
    w_router = torch.randn(E, D, generator=g)
    w_in = torch.randn(E, width, D, generator=g) * 0.3
    w_out = torch.randn(E, D, F_HIDDEN, generator=g) * 0.3
    up = torch.randn(T, D, generator=g)
    return [t.to(dtype) for t in (x, w_router, w_in, w_out, up)]


def _route(x, w_router):
    """Softmax top-k in fp32-or-wider (the gating weights are differentiable through the router weight)."""
    probs = torch.softmax(x @ w_router.T, dim=-1)  # [T, E]
    weights, ids = probs.topk(K, dim=-1)  # [T, K]
    return ids, weights


def _keep(ids, weights, case: str):
    return None if case == "dropless" else capacity_keep(ids, weights.detach().float(), E, C, "probs", None)


def _loop_reference(x, ids, weights, keep, w_in, w_out, activation):
    """y[t] = sum over kept k of weights[t, k] * expert_{ids[t, k]}(x[t]), one expert at a time."""
    kept = torch.ones_like(ids, dtype=torch.bool) if keep is None else keep
    y = torch.zeros_like(x)
    for e in range(E):
        tok, slot = ((ids == e) & kept).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w_in[e].T
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(h)
        y = y.index_add(0, tok, (a @ w_out[e].T) * weights[tok, slot, None])
    return y


def _run(make, activation: str, dtype: torch.dtype, case: str, reference: bool):
    """(y, dx, d router weight, d w_in, d w_out) and, for the dispatchers, the layout facts of the capacity case."""
    x, w_router, w_in, w_out, up = _inputs(activation, dtype)
    x, w_router = x.requires_grad_(), w_router.requires_grad_()
    dispatcher = None if reference else make()
    # a dispatcher that fuses the experts hands the tokens to the fused backend's one Function
    backend = "fused" if dispatcher is not None and dispatcher.fuses_experts else "loop"
    experts = RoutedExperts(E, D, F_HIDDEN, activation, backend=backend).to(dtype)
    with torch.no_grad():
        experts.w_in.copy_(w_in)
        experts.down_proj.copy_(w_out)
    ids, weights = _route(x, w_router)
    keep = _keep(ids, weights, case)
    facts = {}
    if reference:
        y = _loop_reference(x, ids, weights, keep, experts.w_in, experts.down_proj, activation)
    else:
        assert dispatcher is not None
        if case == "dropless" and dispatcher.fuses_experts:
            y = dispatcher.forward(x, ids, weights, experts)
        else:
            layout = C if case == "capacity_layout" else None
            rows, counts, meta = dispatcher.dispatch(x, ids, weights, keep=keep, capacity=layout)
            y = dispatcher.combine(experts(rows, counts), meta)
            kept = torch.ones_like(ids, dtype=torch.bool) if keep is None else keep
            per_expert = torch.stack([((ids == e) & kept).sum() for e in range(E)])
            facts = {"counts": counts.detach().clone(), "kept_per_expert": per_expert, "rows": rows.shape[0],
                     "zero_rows": int((rows.detach() == 0).all(dim=1).sum())}
    (y * up).sum().backward()
    grads = [y.detach(), x.grad, w_router.grad, experts.w_in.grad, experts.down_proj.grad]
    return grads, facts


def _all_results(rank: int, world: int, out_dir):
    """In a forked one-rank gloo group: every dispatcher on every case, and the loop reference."""
    from _parallel_util import ep_mesh

    mesh = ep_mesh(1)
    makers = {
        "local": lambda: LocalDispatcher(E),
        "fused_local": lambda: FusedLocalDispatcher(E),
        "all_to_all": lambda: AllToAllDispatcher(E, mesh),
        "all_gather": lambda: AllGatherDispatcher(E, mesh),
    }
    results = {}
    for activation in ACTIVATIONS:
        for dname, dtype in DTYPES.items():
            for case in CASES:
                results[("reference", activation, dname, case)] = _run(None, activation, dtype, case, True)
                for name, make in makers.items():
                    results[(name, activation, dname, case)] = _run(make, activation, dtype, case, False)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(_all_results, 1, tmp_path_factory.mktemp("conformance"))[0]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("name", NAMES)
def test_dispatcher_equals_the_loop_reference(results, name, activation, dtype, case):
    got, facts = results[(name, activation, dtype, case)]
    ref, _ = results[("reference", activation, dtype, case)]
    tol = 1e-12 if dtype == "fp64" else 2e-5
    for what, a, b in zip(["y", "d tokens", "d router weight", "d w_in", "d w_out"], got, ref):
        assert a.dtype == b.dtype, what  # no cast through another dtype on the way
        assert (a - b).abs().max() <= tol * b.abs().max().clamp(min=1.0), (name, what)
    if case == "drop":  # grouped layout: kept rows per expert, dropped ones after the last expert
        assert torch.equal(facts["counts"], facts["kept_per_expert"]), name
    if case == "capacity_layout":  # C rows per expert; the slots no kept assignment fills are exact zeros
        assert facts["counts"].tolist() == [C] * E and facts["rows"] == E * C, name
        assert facts["zero_rows"] >= E * C - int(facts["kept_per_expert"].sum()), name


def test_the_capacity_case_really_drops(results):
    _, facts = results[("local", "swiglu", "fp64", "drop")]
    assert int(facts["kept_per_expert"].sum()) < T * K  # some assignments dropped
    assert int(facts["kept_per_expert"].max()) == C  # and at least one expert full


@pytest.mark.parametrize("cls", [LocalDispatcher, FusedLocalDispatcher, AllToAllDispatcher, AllGatherDispatcher])
def test_every_dispatcher_declares_its_capabilities(cls):
    assert issubclass(cls, Dispatcher)
    assert isinstance(cls.supports_capacity, bool) and isinstance(cls.fuses_experts, bool)
    assert cls.supports_capacity  # all four drop and pad
    assert cls.fuses_experts == (cls is FusedLocalDispatcher)


class _DroplessOnly(Dispatcher):
    """A dispatcher that declares no capacity support (e.g. a future dropless-only EP dispatcher)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.inner = LocalDispatcher(num_experts)

    def dispatch(self, tokens, topk_ids, topk_weights, keep=None, capacity=None):
        self.require_dropless(keep, capacity)
        return self.inner.dispatch(tokens, topk_ids, topk_weights)

    def combine(self, expert_out, meta):
        return self.inner.combine(expert_out, meta)


def test_a_dropless_only_dispatcher_refuses_capacity_clearly():
    x, w_router, *_ = _inputs("swiglu", torch.float32)
    ids, weights = _route(x, w_router)
    keep = _keep(ids, weights, "drop")
    dispatcher = _DroplessOnly(E)
    dispatcher.dispatch(x, ids, weights)  # dropless is fine
    with pytest.raises(ValueError, match=r"keep / capacity: _DroplessOnly is dropless only.*capacity=5"):
        dispatcher.dispatch(x, ids, weights, keep=keep, capacity=C)
    with pytest.raises(NotImplementedError, match="fuses_experts=False"):
        dispatcher.forward(x, ids, weights, None)

    cfg = MoEConfig(num_experts=E, top_k=K, experts=ExpertsConfig(ffn_hidden=F_HIDDEN),
                    capacity=CapacityConfig(factor=1.0))
    layer = MoELayer(D, cfg, ExecutionConfig(moe_backend="loop"))
    layer.set_dispatcher(_DroplessOnly(E))
    with pytest.raises(ConfigError, match=r"capacity.factor=1.0.*_DroplessOnly is dropless only"):
        layer(x[None])


def test_set_dispatcher_refuses_an_object_that_is_not_a_dispatcher():
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, experts=ExpertsConfig(ffn_hidden=F_HIDDEN)))
    with pytest.raises(TypeError, match="not a moetrain.moe.dispatcher.Dispatcher"):
        layer.set_dispatcher(object())


@pytest.mark.parametrize("backend,expected", [("fused", FusedLocalDispatcher), ("loop", LocalDispatcher),
                                              ("grouped_mm", LocalDispatcher), ("padded", LocalDispatcher)])
def test_the_default_dispatcher_is_chosen_from_the_backend(backend, expected):
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, experts=ExpertsConfig(ffn_hidden=F_HIDDEN)),
                     ExecutionConfig(moe_backend=backend))
    assert type(layer.dispatcher) is expected


@pytest.mark.parametrize("keep", [False, True])
def test_local_dispatch_of_no_tokens(keep):
    """An expert-parallel serving rank whose share of a step is empty (fewer tokens than ranks) dispatches and
    combines zero tokens, also with a keep mask (a dynamic top-k policy): [0, D] back, no error."""
    d = LocalDispatcher(E)
    ids, w = torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K)
    rows, tpe, meta = d.dispatch(torch.zeros(0, D), ids, w, keep=torch.zeros(0, K, dtype=torch.bool) if keep else None)
    assert rows.shape == (0, D) and tpe.tolist() == [0] * E
    assert d.combine(rows, meta).shape == (0, D)
