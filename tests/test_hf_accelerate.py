"""moetrain.hf.accelerate: transformers' sparse MoE blocks swapped for ours keep loss (with the HF aux loss from
output_router_logits) and every gradient equal to the unmodified model; the Trainer callback logs what the
router chose. Reference: the unmodified transformers model on CPU, fp32."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moetrain.errors import ConfigError
from moetrain.hf import (
    AcceleratedMoeBlock,
    MoELoggingCallback,
    accelerate,
    add_moe_logging,
)

V = 97
COMMON = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_experts_per_tok": 2, "output_router_logits": True,
          "router_aux_loss_coef": 0.1, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
FAMILIES = {
    "mixtral": {"intermediate_size": 24, "num_local_experts": 4},
    "qwen2_moe": {"intermediate_size": 40, "moe_intermediate_size": 24, "num_experts": 4,
                  "shared_expert_intermediate_size": 20},
    "qwen3_moe": {"intermediate_size": 40, "moe_intermediate_size": 24, "num_experts": 4, "norm_topk_prob": True},
    "olmoe": {"intermediate_size": 24, "num_experts": 4},
    "dots1": {"intermediate_size": 40, "moe_intermediate_size": 24, "n_routed_experts": 4, "n_shared_experts": 1,
              "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.0, "norm_topk_prob": True},
    "deepseek_v3": {"intermediate_size": 40, "moe_intermediate_size": 24, "n_routed_experts": 4, "n_shared_experts": 1,
                    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.0, "first_k_dense_replace": 1,
                    "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 8, "qk_nope_head_dim": 8},
}


@torch.no_grad()
def _hf(family: str, **extra):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    for name, p in model.named_parameters():  # some families zero-initialise the router
        if name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.5)
    for name, b in model.named_buffers():
        if "e_score_correction_bias" in name:
            b.normal_(0.0, 0.1)
    return model.train()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, 16), generator=g)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_gradients_match_unmodified_model(family):
    ref = _hf(family)
    acc = copy.deepcopy(ref)
    experts_before = acc.model.layers[1].mlp.experts.gate_up_proj
    stats = accelerate(acc)
    block = acc.model.layers[1].mlp
    assert isinstance(block, AcceleratedMoeBlock) and block.experts.gate_up_proj is experts_before
    assert acc.state_dict().keys() == ref.state_dict().keys()

    ids = _batch()
    out_ref, out_acc = ref(ids, labels=ids), acc(ids, labels=ids)
    if out_ref.aux_loss is not None:  # the HF aux loss still sees the router logits (OutputRecorder on the gate)
        assert out_acc.aux_loss is not None and len(out_acc.router_logits) == len(out_ref.router_logits)
        assert abs(out_ref.aux_loss.item() - out_acc.aux_loss.item()) <= 1e-5
    assert abs(out_ref.loss.item() - out_acc.loss.item()) <= 1e-5
    out_ref.loss.backward()
    out_acc.loss.backward()
    grads = dict(acc.named_parameters())
    for name, p in ref.named_parameters():
        assert (p.grad is None) == (grads[name].grad is None), name
        if p.grad is not None:
            diff = (p.grad - grads[name].grad).abs().max().item()
            assert diff <= 1e-5, (name, diff)
    assert stats.has_data() and stats.layers == [i for i, layer in enumerate(acc.model.layers)
                                                 if isinstance(layer.mlp, AcceleratedMoeBlock)]


def test_loop_backend_and_mixtral_jitter_match():
    ref = _hf("mixtral", router_jitter_noise=0.1)
    acc = copy.deepcopy(ref)
    accelerate(acc, backend="loop")
    ids = _batch()
    torch.manual_seed(5)
    loss_ref = ref(ids, labels=ids).loss
    torch.manual_seed(5)  # the same jitter draws
    loss_acc = acc(ids, labels=ids).loss
    assert abs(loss_ref.item() - loss_acc.item()) <= 1e-5


def test_refuses_models_without_moe_blocks():
    config = transformers.AutoConfig.for_model("llama", vocab_size=V, hidden_size=32, intermediate_size=40,
                                               num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ConfigError, match="no supported sparse MoE block"):
        accelerate(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(ConfigError, match="unknown backend"):
        accelerate(_hf("mixtral"), backend="cuda-magic")


def test_trainer_callback_logs_router_choices(tmp_path):
    """Two optimizer steps logged one by one: the logged token counts equal the experts the HF gate modules chose
    (recorded by forward hooks, independently of our statistics), and the aux loss equals the Switch loss of
    the recorded logits computed here by hand."""
    model = _hf("qwen3_moe")
    stats = accelerate(model)
    chosen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {0: [], 1: []}

    def hook(layer):
        def record(module, args, output):
            if module.training:
                chosen[layer].append((output[0].detach(), output[2].detach()))
        return record

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(hook(i))

    seen: list[dict] = []

    class Recorder(transformers.TrainerCallback):  # stands in for TensorBoard & co, which run after ours
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                seen.append({**logs, "_forwards": {i: list(v) for i, v in chosen.items()}})
                for v in chosen.values():
                    v.clear()

    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, V, (4, 12), generator=torch.Generator()
                                                                           .manual_seed(2))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                                          logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                          disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Recorder()])
    callback = add_moe_logging(trainer, stats)
    assert isinstance(callback, MoELoggingCallback) and trainer.callback_handler.callbacks[0] is callback
    trainer.train()

    assert len(seen) == 2
    for logs in seen:
        for layer, forwards in logs["_forwards"].items():
            assert len(forwards) == 1
            logits, ids = forwards[0]
            expected = torch.bincount(ids.reshape(-1), minlength=4).tolist()
            got = [logs[f"moe/layer{layer}/expert_{e}_tokens"] for e in range(4)]
            assert got == expected, (layer, got, expected)
            # the trainer's stat name and definition (moe/layerL/overload = max / mean load)
            assert logs[f"moe/layer{layer}/overload"] == pytest.approx(max(expected) / (sum(expected) / 4))
            # Switch loss by hand: E * sum_e (share of assignments to e) * (mean router probability of e).
            probs = torch.softmax(logits.float(), dim=-1)
            share = torch.tensor(expected, dtype=torch.float32) / ids.numel()
            aux = 4 * float((share * probs.mean(dim=0)).sum())
            assert abs(logs[f"moe/layer{layer}/aux_loss"] - aux) < 1e-5
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert all("moe/aux_loss" in h for h in history)
