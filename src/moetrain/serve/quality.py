"""What an inference-time change costs (the int8 router, int8 experts): routing agreement and loss change against
the fp32 model.

Legend: B = batch, S = sequence, T = tokens, E = experts, K = top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    hooks = [layer.router.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach()))
             for layer in layers]
    try:
        logits = model(input_ids).logits
    finally:
        for h in hooks:
            h.remove()
    loss_fp32 = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))
    same, total = 0, 0
    for layer, x in zip(layers, inputs):
        k = layer.config.top_k
        fp = layer.router(x).topk_ids.sort(dim=-1).values
        q = Int8Router(layer.router.weight)
        x32 = x.float()
        r = _route_int8(layer, q.logits(x32), k)
        same += int((fp == r.sort(dim=-1).values).all(dim=-1).sum())
        total += fp.shape[0]
    originals = [layer.router.weight.data.clone() for layer in layers]
    try:
        for layer in layers:
            layer.router.weight.data.copy_(Int8Router(layer.router.weight).dequantized())
        logits8 = model(input_ids).logits
    finally:
        for layer, w in zip(layers, originals):
            layer.router.weight.data.copy_(w)
    loss_int8 = F.cross_entropy(logits8[:, :-1].reshape(-1, logits8.shape[-1]).float(), input_ids[:, 1:].reshape(-1))
    return {"agreement": same / max(total, 1), "loss_fp32": float(loss_fp32), "loss_int8": float(loss_int8),
            "loss_change": float(loss_int8 - loss_fp32), "tokens": total}


def _route_int8(layer, logits: torch.Tensor, k: int) -> torch.Tensor:
    """[T, K] expert ids chosen from int8-router ``logits`` [T, E] with the layer's routing settings."""
    from moetrain.moe.router import route

    c = layer.config
    r = route(logits, k, score_func=c.router.score_func, norm_topk_prob=c.router.norm_topk_prob,
              routed_scaling_factor=c.router.routed_scaling_factor, num_groups=c.router.num_groups,
              topk_groups=c.router.topk_groups, expert_bias=layer.router.e_score_correction_bias)
    return r.topk_ids


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
        hooks = [layer.router.register_forward_hook(
            lambda mod, args, out: chosen.append(out.topk_ids.sort(dim=-1).values)) for layer in layers]
        try:
            logits = model(input_ids).logits
        finally:
            for h in hooks:
                h.remove()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))
        return loss, chosen

    loss_fp32, fp = run()
    q = Int8Experts(model)
    originals = [(layer.experts.w_in.data.clone(), layer.experts.down_proj.data.clone()) for layer in layers]
    try:
        for layer, b in zip(layers, q.blocks):
            w_in, w_out = q.weights[b]
            layer.experts.w_in.data.copy_(w_in.dequantized())
            layer.experts.down_proj.data.copy_(w_out.dequantized())
        loss_int8, i8 = run()
    finally:
        for layer, (w_in, w_out) in zip(layers, originals):
            layer.experts.w_in.data.copy_(w_in)
            layer.experts.down_proj.data.copy_(w_out)
    per_layer = [float((a == b).all(dim=-1).float().mean()) for a, b in zip(fp, i8)]
    same = sum(int((a == b).all(dim=-1).sum()) for a, b in zip(fp, i8))
    total = sum(a.shape[0] for a in fp)
    return {"agreement": same / max(total, 1), "agreement_per_layer": per_layer, "loss_fp32": float(loss_fp32),
            "loss_int8": float(loss_int8), "loss_change": float(loss_int8 - loss_fp32), "tokens": total,
            "bytes_fp32": q.fp32_bytes, "bytes_int8": q.nbytes()}
