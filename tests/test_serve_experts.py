"""Hot/cold experts under ``--expert-memory-budget`` (moetrain/serve/expert_store.py, expert_usage.py): with half the
experts' bytes the server gives the unlimited server's greedy tokens and logits, the resident expert bytes
(measured from the store's live tensors after every page-in and every step) never exceed the budget, and cold
experts really are paged in and evicted."""

from __future__ import annotations

import json
import threading
from argparse import Namespace

import pytest
import torch

from _serve_util import train_tiny

from moetrain.errors import MoetrainError
from moetrain.model.attention import KVCache
from moetrain.serve.engine import Engine, GenRequest
from moetrain.configlib import parse_size
from moetrain.serve.expert_store import ExpertStore, routed_expert_bytes, unit_bytes
from moetrain.serve.expert_usage import calibrate_usage, served_usage, uniform_usage, usage_from_metrics
from moetrain.serve.forward import StepBatch, StepRunner
from moetrain.serve.loader import load_served_model
from moetrain.serve.moe import StepPolicies
from moetrain.serve.routing import RoutingPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["ROMEO:", "The king is", "Speak, friend, and", "O night, sweet night", "What light", "Good morrow"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("experts"))


def _live_bytes(store: ExpertStore) -> int:
    """The test's own measure: bytes of the distinct storages behind the store's resident tensors."""
    storages = {}
    for pair in (*store.pinned.values(), *store.pool.values()):
        for t in pair:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _watch(store: ExpertStore, seen: list[int]) -> None:
    """Record the live bytes after every ``get`` (every page-in happens inside one)."""
    get = store.get

    def watched(unit):
        out = get(unit)
        seen.append(_live_bytes(store))
        return out

    store.get = watched  # type: ignore[method-assign]


def _generate(served, prompts, n, **engine_kwargs) -> list[list[int]]:
    engine = Engine(served, num_slots=4, **engine_kwargs)
    engine.start()
    done = threading.Semaphore(0)
    reqs = [GenRequest(served.tokenizer.encode(p).ids, n, lambda ev: ev.finish_reason and done.release())
            for p in prompts]
    for r in reqs:
        engine.submit(r)
    for _ in reqs:
        done.acquire()
    engine.stop()
    return [r.out_ids for r in reqs]


def _steps_logits(served, experts_fn=None) -> list[torch.Tensor]:
    """Logits of a prefill of three prompts then 4 decode steps feeding back greedy tokens."""
    cfg = served.model.config
    kw = {} if experts_fn is None else {"experts_fn": experts_fn}
    runner = StepRunner(served.model, KVCache(cfg.n_layers, 3, cfg.max_seq_len), **kw)
    prompts = [served.tokenizer.encode(p).ids for p in PROMPTS[:3]]
    seqs = [(i, 0, ids) for i, ids in enumerate(prompts)]
    pol = RoutingPolicy()
    out = []
    for _ in range(5):
        batch = StepBatch.build(seqs)
        logits, _ = runner.step(batch, StepPolicies(((pol, int(batch.input_ids.numel())),)))
        out.append(logits)
        nxt = logits.argmax(dim=-1).tolist()
        seqs = [(slot, start + len(toks), [t]) for (slot, start, toks), t in zip(seqs, nxt)]
    return out


def test_half_budget_equals_unlimited_and_stays_under_budget(run):
    ref_served = load_served_model(str(run))
    ref_tokens = _generate(ref_served, PROMPTS, 24)
    ref_logits = _steps_logits(ref_served)

    served = load_served_model(str(run))
    total = routed_expert_bytes(served.model)
    budget = total // 2
    usage = served_usage(served)
    assert usage.source.startswith("metrics.jsonl")  # the tiny run logged its routing statistics
    store = ExpertStore(served.model, budget, usage, served.experts_file())
    seen: list[int] = []
    _watch(store, seen)
    # the model's own expert weights are released: only the store's copies hold expert bytes
    assert all(layer.experts.down_proj.is_meta for layer in served.model.moe_layers())
    assert _live_bytes(store) <= budget

    logits = _steps_logits(served, store.experts_forward)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    per_step: list[int] = []
    engine_store = Engine(served, num_slots=4, expert_store=store)
    record = engine_store._record

    def recorded(*a, **kw):
        record(*a, **kw)
        per_step.append(_live_bytes(store))

    engine_store._record = recorded  # type: ignore[method-assign]
    engine_store.start()
    done = threading.Semaphore(0)
    reqs = [GenRequest(served.tokenizer.encode(p).ids, 24, lambda ev: ev.finish_reason and done.release())
            for p in PROMPTS]
    for r in reqs:
        engine_store.submit(r)
    for _ in reqs:
        done.acquire()
    engine_store.stop()
    assert [r.out_ids for r in reqs] == ref_tokens

    assert seen and per_step and max(seen + per_step) <= budget
    assert store.stats.peak_bytes <= budget
    # cold experts were streamed: page-ins and evictions happened, and the budget was actually used
    assert store.stats.misses > 0 and store.stats.evictions > 0
    assert max(seen) > total // 4
    metrics = engine_store.metrics.render().decode()
    assert "moetrain_expert_pageins_total" in metrics
    store.close()


def test_quarter_budget_and_spill_file(run, tmp_path):
    """A budget of one quarter (below one layer's experts: a layer computes expert by expert, evicting as it goes),
    the experts read from a spill file (the HF-directory path), same greedy tokens."""
    ref_tokens = _generate(load_served_model(str(run)), PROMPTS[:3], 16)
    served = load_served_model(str(run))
    total = routed_expert_bytes(served.model)
    e = served.model.moe_layers()[0].config.num_experts
    budget = total // 4
    assert budget < e * unit_bytes(served.model)  # one layer's experts do not all fit
    store = ExpertStore(served.model, budget, uniform_usage([0, 1], e), None, hot_share=0.25,
                        spill_dir=str(tmp_path))
    spill = list(tmp_path.iterdir())
    assert len(spill) == 1 and spill[0].suffix == ".safetensors"
    seen: list[int] = []
    _watch(store, seen)
    assert _generate(served, PROMPTS[:3], 16, expert_store=store) == ref_tokens
    assert max(seen) <= budget and store.stats.misses > 0
    store.close()
    assert not spill[0].exists()


def test_store_refuses_small_budget_and_mismatched_file(run, tmp_path):
    served = load_served_model(str(run))
    unit = unit_bytes(served.model)
    with pytest.raises(MoetrainError, match="--expert-memory-budget: .* less than one expert"):
        ExpertStore(served.model, unit - 1, uniform_usage([0, 1], 4), served.experts_file())
    from safetensors.torch import save_file

    bad = {k: v.clone() for k, v in served.model.state_dict().items() if ".experts." in k}
    bad["blocks.1.ffn.experts.down_proj"][2, 0, 0] += 1.0
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(MoetrainError, match="blocks.1.ffn.experts.down_proj differs"):
        ExpertStore(served.model, 10 * unit, uniform_usage([0, 1], 4), tmp_path / "bad.safetensors")


def test_hot_experts_are_pinned_by_usage(run):
    served = load_served_model(str(run))
    unit = unit_bytes(served.model)
    counts = torch.tensor([[1.0, 50, 2, 3], [40, 1, 1, 30]], dtype=torch.float64)
    from moetrain.serve.expert_usage import ExpertUsage

    store = ExpertStore(served.model, 5 * unit, ExpertUsage((0, 1), counts, "test"), served.experts_file(),
                        hot_share=0.5)
    # shares: (0,1) 50/56, (1,0) 40/72, (1,3) 30/72 ...; 2 pinned (2.5 units -> 2), 3 in the pool
    assert set(store.pinned) == {(0, 1), (1, 0)}
    assert len(store.pool) == 3 and set(store.pool) == {(1, 3), (0, 3), (0, 2)}
    assert list(store.pool)[0] == (0, 2)  # the least hot is the first evicted


def test_usage_from_metrics_and_calibration(run, tmp_path):
    lines = [{"step": 10, "moe/layer0/tokens": [1, 2, 3, 4], "moe/layer1/tokens": [4, 3, 2, 1]},
             {"step": 20, "val_loss": 3.0},
             {"step": 20, "moe/layer0/tokens": [10, 0, 0, 0], "moe/layer1/tokens": [0, 0, 0, 10]},
             {"step": 30, "moe/layer0/tokens": [100, 0, 0, 0], "moe/layer1/tokens": [0, 0, 0, 100]}]
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    u = usage_from_metrics(f, [0, 1], 4, up_to_step=20)
    assert u is not None and u.counts.tolist() == [[11, 2, 3, 4], [4, 3, 2, 11]] and u.source.endswith("10-20")
    u = usage_from_metrics(f, [0, 1], 4, intervals=1)
    assert u is not None and u.counts.tolist() == [[100, 0, 0, 0], [0, 0, 0, 100]]
    assert usage_from_metrics(tmp_path / "none.jsonl", [0, 1], 4) is None
    f.write_text(json.dumps({"step": 1, "moe/layer0/tokens": [1, 2], "moe/layer1/tokens": [1, 2]}) + "\n")
    with pytest.raises(MoetrainError, match="moe/layer0/tokens has 2 entries"):
        usage_from_metrics(f, [0, 1], 4)

    served = load_served_model(str(run))
    ids = served.tokenizer.encode("To be, or not to be, that is the question. " * 6).ids
    cal = calibrate_usage(served.model, ids, chunk=32)
    k = served.model.moe_layers()[0].config.top_k
    assert cal.counts.sum(dim=1).tolist() == [len(ids) * k] * 2
    # the same counts as the training router module's own top-k over the model's forward
    got: list[torch.Tensor] = []
    hooks = [layer.router.register_forward_hook(lambda m, a, out: got.append(out.topk_ids))
             for layer in served.model.moe_layers()]
    with torch.no_grad():
        for s in range(0, len(ids), 32):
            served.model(torch.tensor([ids[s:s + 32]]))
    for h in hooks:
        h.remove()
    ref = torch.zeros(2, 4, dtype=torch.float64)
    for i, t in enumerate(got):
        ref[i % 2] += torch.bincount(t.reshape(-1), minlength=4).double()
    assert cal.counts.tolist() == ref.tolist()


def test_parse_bytes_and_cli_flag(run):
    def parse(text):
        return parse_size(text, "--expert-memory-budget")

    # The documented spellings: bare K/M/G and KiB/MiB/GiB binary; KB/MB/GB decimal (as transformers reads them).
    assert parse("4096") == 4096 and parse("64M") == 64 << 20 and parse("1.5G") == 3 << 29
    assert parse("2KiB") == 2048 and parse("64MiB") == 64 << 20 and parse("1GB") == 10**9
    for bad in ("lots", "-1", "M", "0"):
        with pytest.raises(ValueError, match=f"--expert-memory-budget {bad!r}"):
            parse(bad)
    from moetrain.commands.serve import open_store

    served = load_served_model(str(run))
    args = Namespace(expert_memory_budget="12", hot_share=0.5, calibration_text=None)
    with pytest.raises(MoetrainError, match="--expert-memory-budget: 12 bytes is less than one expert"):
        open_store(args, served)
    args = Namespace(expert_memory_budget="a lot", hot_share=0.5, calibration_text=None)
    with pytest.raises(MoetrainError, match="--expert-memory-budget 'a lot': not a byte count"):
        open_store(args, served)
    args = Namespace(expert_memory_budget=str(routed_expert_bytes(served.model) // 2), hot_share=0.5,
                     calibration_text=None)
    store = open_store(args, served)
    assert len(store.pinned) + len(store.pool) == 4
    store.close()
