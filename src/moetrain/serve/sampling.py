"""Next-token choice, the same computation as :func:`moetrain.model.generate.generate` (so a seeded request
samples the same tokens as ``moetrain generate --seed``)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """logits: [V] fp32 -> the next token id: argmax at temperature 0, else nucleus sampling (the smallest set of
    tokens whose probability mass reaches ``top_p``) from ``softmax(logits / temperature)``."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits[None] / temperature, dim=-1)  # [1, V], as generate's batch of one
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
    choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)  # [1, 1]
    return int(sorted_ids.gather(-1, choice))
