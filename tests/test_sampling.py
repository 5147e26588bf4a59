"""The one sampler (moetrain.model.sampling) of `moetrain generate` and `moetrain serve`: values users send
normalised (a temperature or top_p that underflows in fp32), a row that cannot be sampled isolated from the
others, and bias / penalties against OpenAI's formula written out by hand."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.sampling import (
    SamplingError,
    SamplingParams,
    argmax_rows,
    inverse_cdf,
    sample_rows,
    token_logprobs,
)


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token():
    """temperature 1e-300 divided the logits into infinities and top_p 1e-300 rounds to 0 in fp32: both raised
    inside torch.multinomial and failed the whole batch. Now: greedy, and the most likely token."""
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    top = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=0.0),
                   SamplingParams(temperature=0.8, top_p=1e-300), SamplingParams(temperature=5.0, top_p=1e-45)):
        got = sample_rows(logits, [params] * 4, [torch.Generator().manual_seed(i) for i in range(4)])
        assert got == top, params


def test_a_row_that_cannot_be_sampled_gets_its_own_error_and_the_others_their_tokens():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    logits[2] = float("nan")  # a row whose distribution is not finite
    params = [SamplingParams(0.9, 0.95)] * 6
    params[4] = SamplingParams(0.9, 0.95, logit_bias=((999, 5.0),))  # a token id outside the vocabulary
    want = sample_rows(logits[[0, 1, 3, 5]], [params[0]] * 4, [torch.Generator().manual_seed(i) for i in (0, 1, 3, 5)])
    got = sample_rows(logits, params, [torch.Generator().manual_seed(i) for i in range(6)])
    assert isinstance(got[2], SamplingError) and "not finite" in str(got[2])
    assert isinstance(got[4], SamplingError) and "999" in str(got[4])
    assert [got[i] for i in (0, 1, 3, 5)] == want  # the same draws as without the failing rows


def test_bias_and_penalties_follow_openais_formula():
    """logit[j] + bias[j] - frequency * count[j] - presence * (count[j] > 0), then greedy: written out by hand."""
    logits = torch.tensor([[2.0, 1.9, 1.0, 0.5, -1.0]])
    generated = [0, 0, 1]  # token 0 twice, token 1 once
    p = SamplingParams(0.0, presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((3, 1.2),))
    # 0: 2.0 - 0.6 - 0.5 = 0.9; 1: 1.9 - 0.3 - 0.5 = 1.1; 2: 1.0; 3: 0.5 + 1.2 = 1.7; 4: -1.0
    assert sample_rows(logits, [p], [None], [generated]) == [3]
    assert sample_rows(logits, [SamplingParams(0.0, logit_bias=((4, 100.0),))], [None]) == [4]
    assert sample_rows(logits, [SamplingParams(0.0, logit_bias=((0, -100.0),))], [None]) == [1]
    assert sample_rows(logits, [SamplingParams(0.0)], [None], [generated]) == [0]  # no penalty: unchanged


@pytest.mark.parametrize("kwargs, field", [({"temperature": float("nan")}, "temperature"),
                                           ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                           ({"presence_penalty": 2.5}, "presence_penalty"),
                                           ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                                           ({"logit_bias": ((1, 101.0),)}, "logit_bias")])
def test_out_of_range_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _first_above(mass, u):
    """The inverse-CDF draw written out: the first index whose running (fp64) sum exceeds u * total."""
    target, cum = u * sum(mass), 0.0
    for j, m in enumerate(mass):
        cum += m
        if cum > target:
            return j
    return max(j for j, m in enumerate(mass) if m > 0)  # u * total rounded up to the total


def test_inverse_cdf_equals_the_loop_and_never_draws_a_zero_mass_token():
    torch.manual_seed(3)
    mass = torch.rand(5, 300) ** 4  # V not a multiple of the block: padded with zero mass
    mass[0, :250] = 0.0  # zero-mass blocks and columns before the only mass
    mass[1, 10::2] = 0.0
    mass[2] = 0.0
    mass[2, 7] = 1e-30  # one token
    mass[3, 129] = float("nan")  # cannot be sampled
    us = [0.0, 1e-12, 0.25, 0.5, 0.999, 1.0 - 2.0 ** -53]
    for u in us:
        col, ok = inverse_cdf(mass, torch.full((5,), u, dtype=torch.float64), block=64)
        assert ok == [True, True, True, False, True]
        for r in (0, 1, 2, 4):
            want = _first_above([float(m) for m in mass[r].double()], u)
            assert int(col[r]) == want and mass[r, want] > 0, (r, u)
    # drawn frequencies follow the masses (20,000 draws: within 4 standard deviations)
    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    g = torch.Generator().manual_seed(0)
    draws = [sample_rows(torch.log(p)[None], [SamplingParams(1.0)], [g])[0] for _ in range(20_000)]
    counts = torch.bincount(torch.tensor(draws), minlength=5).double()
    sd = (20_000 * p * (1 - p)).sqrt()
    assert counts[1] == 0 and bool(((counts - 20_000 * p).abs() <= 4 * sd + 1e-9).all()), counts


def test_argmax_rows_equals_torch_argmax():
    """The first maximal index, ties and NaN (counted as maximal) as torch.argmax, for V a multiple of the block
    or not."""
    torch.manual_seed(4)
    for v in (1024, 1000, 64):
        x = (torch.randn(6, v) * 3).round()  # many ties
        x[1, 300 % v] = float("nan")
        x[1, 700 % v] = float("nan")
        x[2] = float("-inf")
        x[3, :] = 5.0
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), v


def test_token_logprobs_are_the_models_log_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    got = token_logprobs(logits, [0, 2], 2)
    lp = torch.log_softmax(logits, -1)
    assert got[0][0] == pytest.approx(float(lp[0, 0]))
    assert [t for t, _ in got[0][1]] == [1, 2] and got[0][1][0][1] == pytest.approx(float(lp[0, 1]))
    assert got[1][0] == pytest.approx(float(lp[1, 2])) and got[1][1][0][0] == 2


def test_generate_takes_the_values_serve_takes():
    """`moetrain generate` ended in a traceback at temperature / top_p 1e-300; it samples with the same sampler as
    serve, so both are the greedy continuation."""
    from moetrain.config import build_config
    from moetrain.model.generate import generate
    from moetrain.model.transformer import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(build_config("tiny").model).eval()
    prompt = torch.randint(0, 500, (1, 5))
    greedy = generate(model, prompt, 6, temperature=0.0)
    assert generate(model, prompt, 6, temperature=1e-300).tolist() == greedy.tolist()
    assert generate(model, prompt, 6, temperature=0.7, top_p=1e-300,
                    generator=torch.Generator().manual_seed(1)).tolist() == greedy.tolist()
