"""Next-token choice, the one sampler of ``moetrain generate`` and ``moetrain serve`` (so a seeded request samples
the same tokens as ``moetrain generate --seed``).

Legend: B = rows (sequences), V = vocabulary.

Per row, in this order (the order of OpenAI's API and vLLM's sampler):

1. ``logit_bias``: a per-token additive bias (OpenAI: -100 bans a token, 100 forces it);
2. presence / frequency penalties over the tokens the row generated so far (OpenAI's definition,
   ``logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)``);
3. greedy (argmax) when ``temperature`` is below :data:`GREEDY_BELOW` (``1e-300`` would divide the logits into
   infinities; a temperature that small is greedy in all but name), else nucleus sampling (Holtzman et al., 2020):
   from ``softmax(logits / temperature)`` keep the smallest set of tokens whose mass reaches ``top_p`` (the most
   likely token always, so a ``top_p`` that underflows to 0 in fp32 keeps one token) and draw from it.

The draw is by inverse CDF (:func:`inverse_cdf`) from one ``u ~ U[0, 1)`` (fp64) of the row's generator, over the
vocabulary in its own order, or most likely first when ``top_p < 1`` (with ``top_p == 1`` nothing is sorted; the
cost: docs/serving.md). Rows without bias or penalties are computed exactly as a batch of one would be (one softmax
/ sort / cumsum per group of rows sharing (temperature, top_p), the same per-row code on the same values, each row
drawing from its own generator), so batching never changes a seeded draw.
A row whose distribution cannot be sampled (not finite, e.g. from NaN logits) gets its own :class:`SamplingError`;
the other rows are sampled as usual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (argmax); also 0, the usual spelling."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next token (validated on construction).

    Attributes:
        temperature: >= 0 and finite; below :data:`GREEDY_BELOW` greedy.
        top_p: nucleus mass in (0, 1].
        presence_penalty / frequency_penalty: in [-2, 2] (OpenAI's range); 0 = off.
        logit_bias: (token id, bias in [-100, 100]) pairs; token ids are checked against V when sampling.

    Raises:
        ValueError: ``"FIELD: must be ..., got VALUE"`` for a value out of range or not finite.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN fails both
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ValueError(f"{name}: must be in [-2, 2], got {v}")
        for tok, bias in self.logit_bias:
            if tok < 0:
                raise ValueError(f"logit_bias: token ids must be >= 0, got {tok}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: biases must be in [-100, 100], got {bias} for token {tok}")

    @property
    def greedy(self) -> bool:
        """Argmax instead of a draw."""
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        """Bias or penalties change the logits before the choice."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0


class SamplingError(Exception):
    """One row's next token could not be sampled (its message says why); the batch's other rows are unaffected."""


def adjust_logits(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int]) -> torch.Tensor:
    """logits: [V] fp32 -> a new [V] tensor with ``params``' bias and penalties applied (``generated``: the tokens
    this sequence produced so far, for the penalties).

    Raises:
        SamplingError: a ``logit_bias`` token id >= V.
    """
    out = logits.clone()
    v = out.shape[-1]
    if params.logit_bias:
        ids = [t for t, _ in params.logit_bias]
        if max(ids) >= v:
            raise SamplingError(f"logit_bias: token id {max(ids)} is not in the vocabulary of {v} tokens")
        out[torch.tensor(ids)] += torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype)
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.int64), minlength=v)[:v].to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                generated: Sequence[Sequence[int]] | None = None) -> list[int | SamplingError]:
    """The next token of each of B sequences (see the module's docstring for the steps).

    Args:
        logits: [B, V] fp32.
        params: B :class:`SamplingParams`.
        generators: B generators (``None``: torch's global one; greedy rows draw nothing).
        generated: B lists of the tokens each row generated so far (for the penalties); ``None`` = none yet.
    Returns:
        B entries: a token id, or the row's :class:`SamplingError` (the other rows are still sampled).
    """
    b = logits.shape[0]
    if all(p.greedy and not p.adjusts_logits for p in params):  # every row greedy as is: one argmax
        return list(argmax_rows(logits).tolist())
    out: list[int | SamplingError] = [0] * b
    rows_logits = logits
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    if adjusted:
        rows_logits = logits.clone()
        for i in adjusted:
            try:
                rows_logits[i] = adjust_logits(logits[i], params[i], generated[i] if generated is not None else ())
            except SamplingError as e:
                out[i] = e
    failed = {i for i, x in enumerate(out) if isinstance(x, SamplingError)}
    greedy = [i for i, p in enumerate(params) if p.greedy and i not in failed]
    if greedy:
        for i, tok in zip(greedy, argmax_rows(rows_logits[greedy]).tolist()):
            out[i] = tok
    groups: dict[tuple[float, float], list[int]] = {}
    for i, p in enumerate(params):
        if not p.greedy and i not in failed:
            groups.setdefault((p.temperature, p.top_p), []).append(i)
    for (t, top_p), rows in groups.items():
        x = rows_logits if len(rows) == b else rows_logits[rows]
        probs = torch.softmax(x / t, dim=-1)  # [R, V]; divided by the Python float
        ids: torch.Tensor | None = None  # the token of each column: the vocabulary's own order unless sorted
        if top_p < 1:
            probs, ids = torch.sort(probs, dim=-1, descending=True)
            # keep a token while the mass before it is < top_p; the most likely one always (top_p may round to 0)
            keep = (probs.cumsum(dim=-1) - probs) < top_p
            keep[:, 0] = True
            probs = probs * keep
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=generators[i]) for i in rows])  # [R]
        col, ok = inverse_cdf(probs, u)
        picked = (col if ids is None else ids.gather(1, col[:, None])[:, 0]).tolist()
        for j, i in enumerate(rows):
            if ok[j]:
                out[i] = picked[j]
            else:
                out[i] = SamplingError(f"the next-token distribution is not finite at temperature {t} (the "
                                       "model's logits hold NaN or infinity)")
    return out


def inverse_cdf(mass: torch.Tensor, u: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, list[bool]]:
    """The draw of :func:`sample_rows`: per row, the first column whose cumulative mass exceeds ``u`` times the row's
    total mass (columns of zero mass are never drawn), in two levels so that nothing of [B, V] is converted or
    cumulated: the blocks of ``block`` columns (fp64 sums, cumulated), then inside the one block drawn (fp64).

    Args:
        mass: [B, V] fp32 unnormalised probabilities (>= 0, or NaN / infinite for a row that cannot be sampled).
        u: [B] fp64 uniforms in [0, 1).
    Returns:
        ([B] int64 drawn columns (0 for a row that cannot be sampled), B bools: whether the row could be sampled
        (its total mass finite and > 0)).
    """
    b, v = mass.shape
    if v % block:
        mass = torch.nn.functional.pad(mass, (0, block - v % block))  # zero mass: never drawn
    blocks = mass.view(b, -1, block)  # [B, nb, block]
    cum = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [B, nb] mass up to each block's end
    total = cum[:, -1]  # [B]
    ok = torch.isfinite(total) & (total > 0)
    target = torch.where(ok, u * total, 0.0)[:, None]  # [B, 1]
    # u * total may round up to the total: then the last block (and, below, its last column) of nonzero mass
    nonzero = (cum > torch.cat([cum.new_zeros(b, 1), cum[:, :-1]], dim=1)).cumsum(dim=-1)  # [B, nb]
    last_block = (nonzero == nonzero[:, -1:]).to(torch.int8).argmax(dim=-1, keepdim=True)  # [B, 1]
    blk = torch.minimum(torch.searchsorted(cum, target, right=True), last_block)  # [B, 1]
    start = torch.where(blk > 0, cum.gather(1, (blk - 1).clamp(min=0)), 0.0)  # mass before the block
    inner = blocks[torch.arange(b), blk[:, 0]].to(torch.float64)  # [B, block]
    inner_cum = inner.cumsum(dim=-1)
    last_col = block - 1 - (inner > 0).flip(-1).to(torch.int8).argmax(dim=-1, keepdim=True)  # last nonzero column
    col = torch.minimum(torch.searchsorted(inner_cum, target - start, right=True), last_col)
    return torch.where(ok[:, None], blk * block + col, 0)[:, 0], ok.tolist()


def argmax_rows(logits: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [B, V] rows ([B] int64: the first maximal index, a NaN counting as maximal),
    computed as the maximum of each block of ``block`` columns, the first best block, then the first maximum
    inside it: ``torch.argmax`` over the last dim runs element by element on CPU (0.11 ms for [16, 8192] on an AMD
    EPYC; this: ~0.02 ms). V not a multiple of ``block``: ``torch.argmax``."""
    b, v = logits.shape
    if v % block or v <= block:
        return logits.argmax(dim=-1)
    blocks = logits.view(b, v // block, block)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [B] first block holding the maximum (amax propagates NaN)
    inner = blocks[torch.arange(b), best].argmax(dim=-1)  # [B] first maximum inside it
    return best * block + inner


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Log-probabilities of the chosen tokens under the model (``log_softmax`` of the raw logits: before bias,
    penalties and temperature, as vLLM reports them) and the ``top`` most likely alternatives.

    Args:
        logits: [R, V] fp32.
        tokens: R chosen token ids.
        top: alternatives per row (0 = none).
    Returns:
        R pairs (chosen token's logprob, [(token id, logprob)] of the ``top`` most likely, most likely first).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = lp.gather(-1, torch.tensor(list(tokens), dtype=torch.int64)[:, None])[:, 0].tolist()
    alts: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top > 0:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return list(zip(chosen, alts))
