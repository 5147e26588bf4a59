"""Issue 3: gradient accumulation is exact: one batch of 4 equal-length sequences gives the same router and expert
gradients as 4 accumulated micro-batches of 1 sequence, for the LM loss, z-loss, sequence-level aux loss and
global-batch aux loss; the per-micro-batch Switch loss is averaged over micro-batches (documented, not exact).
Also: the data-parallel count hook and the once-per-step expert-bias update."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import build_config
from moetrain.model.transformer import MoETransformer
from moetrain.moe.losses import global_load_balancing_loss
from moetrain.train.step import accumulate_gradients, train_step

NO_MOE_LOSS = dict(aux_loss_coeff=0.0, pooled_aux_loss_coeff=0.0, seq_aux_loss_coeff=0.0, global_aux_loss_coeff=0.0,
                   z_loss_coeff=0.0, util_loss_coeff=0.0)


def _model(seed: int = 0, router: dict | None = None, **losses) -> MoETransformer:
    moe = {"losses": {**NO_MOE_LOSS, **losses}, "router": router or {}}
    cfg = build_config("tiny", overrides={"model": {"n_layers": 2, "moe": moe}}).model
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    with torch.no_grad():  # a router with real preferences, so the balancing losses have sizeable gradients
        for layer in model.moe_layers():
            layer.router.weight.normal_(0, 0.5)
    return model.train()


def _batch(seed: int = 1, b: int = 4, s: int = 16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (b, s + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _grads(model: MoETransformer, batches) -> tuple[dict[str, torch.Tensor], object]:
    model.zero_grad(set_to_none=True)
    acc = accumulate_gradients(model, batches, "fp32", torch.device("cpu"))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, acc


TERMS = {
    "lm": {},
    "z_loss": dict(z_loss_coeff=1.0),
    "seq_aux_loss": dict(seq_aux_loss_coeff=1.0),
    "global_aux_loss": dict(global_aux_loss_coeff=1.0),
    "all": dict(z_loss_coeff=0.1, seq_aux_loss_coeff=0.5, global_aux_loss_coeff=0.5),
}


@pytest.mark.parametrize("term", list(TERMS))
def test_accumulation_equals_one_large_batch(term):
    inputs, targets = _batch()
    model = _model(**TERMS[term])
    big, _ = _grads(model, [(inputs, targets)])
    small, _ = _grads(model, [(inputs[i : i + 1], targets[i : i + 1]) for i in range(4)])
    assert big.keys() == small.keys()
    checked = [n for n in big if "router" in n or "experts" in n]
    assert len(checked) == 2 * 3  # router weight, gate_up_proj, down_proj of both MoE layers
    for name in big:
        scale = big[name].abs().max().item()
        assert (big[name] - small[name]).abs().max().item() <= 1e-5 * max(scale, 1e-3), name


def test_global_aux_loss_needs_the_step_counts():
    """The pre-pass matters: micro-batches that used their own counts would not match the large batch."""
    inputs, targets = _batch()
    model = _model(global_aux_loss_coeff=1.0)
    big, _ = _grads(model, [(inputs, targets)])
    model.zero_grad(set_to_none=True)
    for i in range(4):  # naive accumulation: local counts in each micro-batch
        out = model(inputs[i : i + 1], targets[i : i + 1])
        (out.loss / 4).backward()
    naive = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    name = next(n for n in big if n.endswith("router.weight"))
    assert (big[name] - naive[name]).abs().max().item() > 1e-4


def test_switch_loss_is_averaged_over_micro_batches():
    inputs, targets = _batch()
    model = _model(aux_loss_coeff=1.0)
    _, acc = _grads(model, [(inputs[i : i + 1], targets[i : i + 1]) for i in range(4)])
    with torch.no_grad():
        per_micro = []
        for i in range(4):
            out = model(inputs[i : i + 1], targets[i : i + 1])
            per_micro.append(torch.stack([r.aux_loss for r in out.moe]).mean())
        whole = model(inputs, targets)
    assert abs(acc.moe_losses["aux_loss"].item() - torch.stack(per_micro).mean().item()) <= 1e-6
    # Not the large-batch value (the documented difference): the Switch loss is not linear in the batch.
    assert abs(acc.moe_losses["aux_loss"].item() - whole.aux_loss.item()) > 1e-5


def test_count_reducer_hook():
    """A data-parallel reducer sees [L, E] counts once per step and its sum drives the global-batch loss."""
    inputs, targets = _batch()
    model = _model(global_aux_loss_coeff=1.0)
    other_rank = torch.tensor([[5.0, 0.0, 1.0, 2.0], [0.0, 3.0, 3.0, 2.0]])  # pretend counts of another rank
    calls = []

    def reducer(counts):
        calls.append(counts.shape)
        return counts + other_rank

    for grad_accum in (1, 2):
        calls.clear()
        batches = [(inputs[:2], targets[:2]), (inputs[2:], targets[2:])][:grad_accum]
        model.zero_grad(set_to_none=True)
        acc = accumulate_gradients(model, batches, "fp32", torch.device("cpu"), count_reducer=reducer)
        assert calls == [torch.Size([2, 4])]  # once per step: in the forward (1 micro-batch) or the pre-pass
        with torch.no_grad():
            local = sum(model.moe_counts(i) for i, _ in batches)
            outs = [model(i, t, global_counts=local + other_rank) for i, t in batches]
        expected = torch.stack([
            torch.stack([global_load_balancing_loss(r.prob_sum, r.num_tokens, (local + other_rank)[j])
                         for j, r in enumerate(o.moe)]).mean() for o in outs]).mean()
        assert abs(acc.moe_losses["global_aux_loss"].item() - expected.item()) <= 1e-6


def test_expert_bias_updates_once_per_step_from_all_micro_batches():
    model = _model(router={"expert_bias": True, "expert_bias_update_rate": 0.01})
    inputs, targets = _batch()
    batches = iter([(inputs[:2], targets[:2]), (inputs[2:], targets[2:])])
    cfg = build_config("tiny", overrides={"train": {"grad_accum": 2}}).train
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    with torch.no_grad():
        expected_counts = [sum(c) for c in zip(*(model.moe_counts(i) for i in (inputs[:2], inputs[2:])))]
    result = train_step(model, lambda: next(batches), optimizer, scheduler, cfg, torch.device("cpu"))
    for layer, counts, reported in zip(model.moe_layers(), expected_counts, result.tokens_per_expert):
        assert torch.equal(reported, counts)
        expected = 0.01 * torch.sign(counts.mean() - counts)
        assert torch.allclose(layer.router.e_score_correction_bias, expected)
        assert counts.sum() == 4 * 16 * 2  # every real token's K = 2 assignments, both micro-batches
    # Evaluation never moves the bias.
    before = [layer.router.e_score_correction_bias.clone() for layer in model.moe_layers()]
    model.eval()
    with torch.no_grad():
        model(inputs, targets)
    assert all(torch.equal(b, layer.router.e_score_correction_bias) for b, layer in zip(before, model.moe_layers()))
