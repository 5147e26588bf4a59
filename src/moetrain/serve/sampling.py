"""Next-token choice, the same computation as :func:`moetrain.model.generate.generate` (so a seeded request
samples the same tokens as ``moetrain generate --seed``)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """logits: [V] fp32 -> the next token id: argmax at temperature 0, else nucleus sampling (the smallest set of
    tokens whose probability mass reaches ``top_p``) from ``softmax(logits / temperature)``."""
    return sample_rows(logits[None], [temperature], [top_p], [generator])[0]


def sample_rows(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
                generators: list[torch.Generator | None]) -> list[int]:
    """The next token of each of B sequences, as :func:`sample` per row but batched: one argmax over the greedy
    rows, and per group of rows sharing (temperature, top_p) one softmax, sort and cumsum (the per-row work of
    those ops is the same code on the same values as for a batch of one, so each row gets the tokens ``sample``
    gives it); only the draw is per row, with that row's generator.

    Args:
        logits: [B, V] fp32.
        temperatures / top_ps / generators: B values each (0 = greedy; its generator is not used).
    Returns:
        B token ids.
    """
    out = [0] * logits.shape[0]
    greedy = [i for i, t in enumerate(temperatures) if t == 0]
    if greedy:
        for i, tok in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
            out[i] = tok
    groups: dict[tuple[float, float], list[int]] = {}
    for i, (t, p) in enumerate(zip(temperatures, top_ps)):
        if t != 0:
            groups.setdefault((t, p), []).append(i)
    for (t, p), rows in groups.items():
        probs = torch.softmax(logits[rows] / t, dim=-1)  # [R, V]; divided by the Python float, as generate does
        sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
        # keep a token while the mass before it is < top_p (the top token is always kept)
        masked = sorted_probs * ((sorted_probs.cumsum(dim=-1) - sorted_probs) < p)
        choice = torch.cat([torch.multinomial(masked[j:j + 1], 1, generator=generators[i])
                            for j, i in enumerate(rows)])  # [R, 1]
        for i, tok in zip(rows, sorted_ids.gather(-1, choice).view(-1).tolist()):
            out[i] = tok
    return out
