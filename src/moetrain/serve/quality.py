"""What an inference-time change costs (the int8 router, int8 experts): routing agreement and loss change against
the fp32 model.

Legend: B = batch, S = sequence, T = tokens, E = experts, K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from moetrain.moe.router import route
from moetrain.serve.routing import Int8Router


@torch.no_grad()
def int8_router_report(model, input_ids: torch.Tensor) -> dict[str, float]:
    """Compare int8 routers (per-row scale) with the model's fp32 routers on ``input_ids`` [B, S].

    Returns:
        ``agreement``: share of (token, MoE layer) pairs whose top-k expert set is unchanged, with every layer fed
        the fp32 model's hidden states (so the number isolates the router); ``loss_fp32`` / ``loss_int8``: mean
        next-token cross-entropy (nats) of the whole model with fp32 and with int8 routers; ``loss_change`` =
        int8 - fp32.
    """
    layers = model.moe_layers()
    inputs: list[torch.Tensor] = []
    with _hooked(layers, lambda router: router.register_forward_pre_hook(
            lambda mod, args: inputs.append(args[0].detach()))):
        loss_fp32 = _loss(model, input_ids)
    same, total = 0, 0
    for layer, x in zip(layers, inputs):
        c = layer.config
        fp = layer.router(x).topk_ids.sort(dim=-1).values
        r = route(Int8Router(layer.router.weight).logits(x.float()), c.top_k, score_func=c.router.score_func,
                  norm_topk_prob=c.router.norm_topk_prob, routed_scaling_factor=c.router.routed_scaling_factor,
                  num_groups=c.router.num_groups, topk_groups=c.router.topk_groups,
                  expert_bias=layer.router.e_score_correction_bias)
        same += int((fp == r.topk_ids.sort(dim=-1).values).all(dim=-1).sum())
        total += fp.shape[0]
    with _replaced([(layer.router.weight, Int8Router(layer.router.weight).dequantized()) for layer in layers]):
        loss_int8 = _loss(model, input_ids)
    return {"agreement": same / max(total, 1), "loss_fp32": float(loss_fp32), "loss_int8": float(loss_int8),
            "loss_change": float(loss_int8 - loss_fp32), "tokens": total}


@torch.no_grad()
def int8_experts_report(model, input_ids: torch.Tensor) -> dict:
    """Compare the model with int8 weight-only routed experts (:mod:`moetrain.serve.quant_experts`, per-output-row
    scale, dequantised) against fp32 on ``input_ids`` [B, S].

    Returns:
        ``agreement``: share of (token, MoE layer) pairs whose top-k expert set is unchanged when the whole model
        runs with int8 experts (hidden states change from the first MoE layer's output on, so the first MoE
        layer always agrees); ``agreement_per_layer``: the same per MoE layer; ``loss_fp32`` / ``loss_int8``: mean
        next-token cross-entropy (nats); ``loss_change`` = int8 - fp32; ``tokens``: (token, layer) pairs;
        ``bytes_fp32`` / ``bytes_int8``: the routed experts' bytes.
    """
    from moetrain.serve.quant_experts import Int8Experts

    layers = model.moe_layers()

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        chosen: list[torch.Tensor] = []
        with _hooked(layers, lambda router: router.register_forward_hook(
                lambda mod, args, out: chosen.append(out.topk_ids.sort(dim=-1).values))):
            return _loss(model, input_ids), chosen

    loss_fp32, fp = run()
    q = Int8Experts(model)
    with _replaced([(w, qw.dequantized()) for layer, b in zip(layers, q.blocks)
                    for w, qw in zip((layer.experts.w_in, layer.experts.down_proj), q.weights[b])]):
        loss_int8, i8 = run()
    per_layer = [float((a == b).all(dim=-1).float().mean()) for a, b in zip(fp, i8)]
    same = sum(int((a == b).all(dim=-1).sum()) for a, b in zip(fp, i8))
    total = sum(a.shape[0] for a in fp)
    return {"agreement": same / max(total, 1), "agreement_per_layer": per_layer, "loss_fp32": float(loss_fp32),
            "loss_int8": float(loss_int8), "loss_change": float(loss_int8 - loss_fp32), "tokens": total,
            "bytes_fp32": q.fp32_bytes, "bytes_int8": q.nbytes()}


def _loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats, fp32) of ``model`` on ``input_ids`` [B, S]."""
    logits = model(input_ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))


@contextmanager
def _hooked(layers: list, register: Callable) -> Iterator[None]:
    """``register(layer.router)`` for every layer (a hook that records), removed on exit."""
    hooks = [register(layer.router) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def _replaced(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Each (parameter, value): the parameter holds the value inside, its own values again on exit."""
    originals = [p.data.clone() for p, _ in pairs]
    try:
        for p, value in pairs:
            p.data.copy_(value)
        yield
    finally:
        for (p, _), original in zip(pairs, originals):
            p.data.copy_(original)
