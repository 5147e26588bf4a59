"""Autoregressive generation with a KV cache; the next token is chosen by :mod:`moetrain.model.sampling` (the
sampler ``moetrain serve`` uses too)."""

from __future__ import annotations

import torch

from moetrain.model.attention import KVCache
from moetrain.model.sampling import SamplingError, SamplingParams, sample_rows
from moetrain.model.transformer import MoETransformer


@torch.no_grad()
def generate(
    model: MoETransformer,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_p: float = 0.95,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``input_ids`` [B, S] by up to ``max_new_tokens`` tokens; returns [B, S + n] int64.

    A ``temperature`` below :data:`~moetrain.model.sampling.GREEDY_BELOW` (0 included) is greedy (argmax).
    Otherwise logits are divided by ``temperature`` and sampling keeps the smallest set of tokens whose probability
    mass reaches ``top_p`` (Holtzman et al., 2020; :func:`~moetrain.model.sampling.sample_rows`). Stops early when
    every sequence has produced ``eos_id``.

    Raises:
        ValueError: the prompt plus new tokens exceed ``model.config.max_seq_len``, or temperature is negative or not
            finite, or top_p not in (0, 1], or the logits could not be sampled (not finite).
    """
    params = SamplingParams(temperature, top_p)  # validates both (inf would sample uniformly, NaN fails)
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if input_ids.shape[1] + max_new_tokens > model.config.max_seq_len:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"model.max_seq_len={model.config.max_seq_len}"
        )
    model.eval()
    cache = KVCache(model.config.n_layers, input_ids.shape[0], input_ids.shape[1] + max_new_tokens)
    out = input_ids
    b = input_ids.shape[0]
    logits = model(input_ids, kv_cache=cache).logits[:, -1].float()  # [B, V]
    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        picked = sample_rows(logits, [params] * b, [generator] * b)  # rows draw in order from the one generator
        for x in picked:
            if isinstance(x, SamplingError):
                raise ValueError(f"sampling failed: {x}")
        next_ids = torch.tensor(picked, dtype=torch.int64, device=input_ids.device)
        out = torch.cat([out, next_ids[:, None]], dim=1)
        if eos_id is not None:
            done |= next_ids == eos_id
            if bool(done.all()):
                break
        logits = model(next_ids[:, None], kv_cache=cache).logits[:, -1].float()
    return out
