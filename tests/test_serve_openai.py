"""`moetrain serve` through the official `openai` Python client, at the default thread count: completions and
chat completions (streaming and not, usage in the last chunk), the model list and a wrong model's 404, `n`,
`logprobs`, `echo`, `stop`, penalties, `logit_bias`, token-id and list prompts, and the fields the server does not
implement refused by name. References are computed outside the server: `moetrain generate` and plain loops over
the model's full forward."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from _serve_util import start_server, train_tiny  # noqa: E402

from moetrain.model.generate import generate  # noqa: E402
from moetrain.serve.chat import load_chat_template, plain_prompt  # noqa: E402
from moetrain.serve.loader import load_served_model  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return load_served_model(str(train_tiny(tmp_path_factory.mktemp("serve_openai"))))


@pytest.fixture(scope="module")
def server(served):
    srv, engine = start_server(served, num_slots=8)
    yield srv, engine
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _generate(sm, ids: list[int], n: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[int]:
    out = generate(sm.model, torch.tensor([ids]), n, temperature, top_p, eos_id=sm.eos_id,
                   generator=torch.Generator().manual_seed(seed))
    return out[0, len(ids):].tolist()


def _ids(sm, text: str) -> list[int]:
    return sm.tokenizer.encode(text).ids


def _text(sm, ids: list[int]) -> str:
    return sm.tokenizer.decode(ids)


def test_completions_streaming_and_usage(served, client):
    sm = served
    got = client.completions.create(model=sm.name, prompt="ROMEO:", max_tokens=12, temperature=0)
    want = _generate(sm, _ids(sm, "ROMEO:"), 12)
    assert got.choices[0].text == _text(sm, want) and got.model == sm.name
    assert got.usage.prompt_tokens == len(_ids(sm, "ROMEO:")) and got.usage.completion_tokens == len(want)
    chunks = list(client.completions.create(model=sm.name, prompt="ROMEO:", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == got.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert all(c.usage is None for c in chunks[:-1])
    # a seeded sampled request draws what `moetrain generate --seed` draws
    got = client.completions.create(model=sm.name, prompt="The king", max_tokens=16, temperature=0.9, top_p=0.9,
                                    seed=5)
    assert got.choices[0].text == _text(sm, _generate(sm, _ids(sm, "The king"), 16, 0.9, 0.9, seed=5))


def test_chat_completions_use_the_plain_template_on_a_base_model(served, client):
    sm = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is there?"}]
    prompt = plain_prompt(messages)
    assert prompt == "System: Be brief.\n\nUser: Who is there?\n\nAssistant:"
    got = client.chat.completions.create(model=sm.name, messages=messages, max_tokens=10, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == _text(sm, _generate(sm, _ids(sm, prompt), 10))
    chunks = list(client.chat.completions.create(model=sm.name, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == got.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == got.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == got.usage.total_tokens
    # content as a list of text parts is the same message
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who is "}, {"type": "text", "text": "there?"}]}]
    a = client.chat.completions.create(model=sm.name, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=sm.name, messages=[{"role": "user", "content": "Who is there?"}],
                                       max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_a_tokenizer_chat_template_is_rendered(served, tmp_path):
    """A served directory with tokenizer_config.json's chat_template: the prompt is the template's rendering
    (Jinja2, as transformers' apply_chat_template renders it), encoded without added special tokens."""
    from moetrain.serve.api import Api
    from moetrain.serve.engine import Engine

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    ct = load_chat_template(str(tmp_path))
    assert ct.special_tokens
    messages = [{"role": "user", "content": "hi"}]
    assert ct.render(messages) == "<|user|>hi</s><|assistant|>"
    api = Api(Engine(dataclasses.replace(served, root=str(tmp_path)), num_slots=1), None)
    prep = api.prepare(json.dumps({"messages": messages, "max_tokens": 3}).encode(), chat=True)
    assert prep.prompts == [served.tokenizer.encode("<|user|>hi</s><|assistant|>", add_special_tokens=False).ids]
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system messages') }}")
    api = Api(Engine(dataclasses.replace(served, root=str(tmp_path)), num_slots=1), None)
    with pytest.raises(Exception, match="no system messages"):
        api.prepare(json.dumps({"messages": messages}).encode(), chat=True)


def test_models_and_a_wrong_model_name(served, client):
    assert [m.id for m in client.models.list().data] == [served.name]
    assert client.models.retrieve(served.name).id == served.name
    for call in (lambda: client.completions.create(model="gpt-4o", prompt="x", max_tokens=2),
                 lambda: client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}]),
                 lambda: client.models.retrieve("gpt-4o")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "model_not_found" and e.value.body["param"] == "model"


def test_n_choices_are_the_seeded_single_requests(served, client):
    """n=3 with seed s: choice j is what a single request with seed s + j gets."""
    sm = served
    got = client.completions.create(model=sm.name, prompt="O night", max_tokens=10, temperature=1.0, seed=40, n=3,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    for j, c in enumerate(got.choices):
        assert c.model_extra["token_ids"] == _generate(sm, _ids(sm, "O night"), 10, 1.0, 1.0, seed=40 + j)
    assert got.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in got.choices)
    assert len({c.text for c in got.choices}) > 1  # different seeds, different draws
    chat = client.chat.completions.create(model=sm.name, messages=[{"role": "user", "content": "x"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=1, stream=True)
    indices = {c.choices[0].index for c in chat if c.choices}
    assert indices == {0, 1}


def _full_logprobs(sm, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's full forward at every position: [S, V]."""
    with torch.no_grad():
        return torch.log_softmax(sm.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_are_the_models(served, client):
    sm = served
    prompt = _ids(sm, "Speak, friend")
    got = client.completions.create(model=sm.name, prompt="Speak, friend", max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"return_token_ids": True})
    c = got.choices[0]
    toks = c.model_extra["token_ids"]
    lp = _full_logprobs(sm, prompt + toks)
    for i, t in enumerate(toks):
        assert c.logprobs.token_logprobs[i] == pytest.approx(float(lp[len(prompt) - 1 + i, t]), abs=1e-4)
        top = lp[len(prompt) - 1 + i].topk(3)
        alts = c.logprobs.top_logprobs[i]  # keyed by token text: ids that decode alike (partial UTF-8) share a key
        assert 1 <= len(alts) <= 3 and max(alts.values()) == pytest.approx(float(top.values[0]), abs=1e-4)
        assert all(min(abs(v - float(w)) for w in top.values) < 1e-4 for v in alts.values())
    assert c.logprobs.tokens == [_text(sm, [t]) for t in toks]
    chat = client.chat.completions.create(model=sm.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in content)
    assert all(x.logprob <= 0 and x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob for x in content)


def test_echo_stop_token_id_and_list_prompts(served, client):
    sm = served
    plain = client.completions.create(model=sm.name, prompt="ROMEO:", max_tokens=8, temperature=0).choices[0].text
    echoed = client.completions.create(model=sm.name, prompt="ROMEO:", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "ROMEO:" + plain
    by_ids = client.completions.create(model=sm.name, prompt=_ids(sm, "ROMEO:"), max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == plain
    many = client.completions.create(model=sm.name, prompt=["ROMEO:", "The king"], max_tokens=8, temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == plain
    many_ids = client.completions.create(model=sm.name, prompt=[_ids(sm, "ROMEO:"), _ids(sm, "The king")],
                                         max_tokens=8, temperature=0)
    assert [c.text for c in many_ids.choices] == [c.text for c in many.choices]
    long = client.completions.create(model=sm.name, prompt="The king", max_tokens=30, temperature=0.9, seed=2)
    text = long.choices[0].text
    stop = text[6:8]
    stopped = client.completions.create(model=sm.name, prompt="The king", max_tokens=30, temperature=0.9, seed=2,
                                        stop=[stop])
    assert stopped.choices[0].text == text[:text.find(stop)] and stopped.choices[0].finish_reason == "stop"


def _greedy_adjusted(sm, ids: list[int], n: int, presence: float, frequency: float, bias: dict[int, float]):
    """OpenAI's penalties and logit_bias applied by hand over the model's full forward, greedy."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = sm.model(torch.tensor([ids + out])).logits[0, -1].float().clone()
        for t, b in bias.items():
            logits[t] += b
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


def test_penalties_and_logit_bias(served, client):
    sm = served
    ids = _ids(sm, "ROMEO:")
    for kwargs, (presence, frequency, bias) in (
            ({"frequency_penalty": 2.0}, (0.0, 2.0, {})),
            ({"presence_penalty": 1.5, "logit_bias": {"5": 3.0}}, (1.5, 0.0, {5: 3.0})),
            ({"logit_bias": {"7": 100}}, (0.0, 0.0, {7: 100.0}))):
        got = client.completions.create(model=sm.name, prompt="ROMEO:", max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True}, **kwargs)
        want = _greedy_adjusted(sm, ids, 8, presence, frequency, bias)
        assert got.choices[0].model_extra["token_ids"] == want, kwargs
    assert set(want) == {7}  # +100 forces the token


@pytest.mark.parametrize("kwargs, param", [
    ({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"),
    ({"extra_body": {"tools": [{"type": "function"}]}}, "tools"),
    ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"prompt": [10**7]}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options")])
def test_unsupported_or_invalid_fields_are_refused_by_name(served, client, kwargs, param):
    kwargs = {"model": served.name, "prompt": "x", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kwargs)
    assert e.value.body["param"] == param and param in e.value.body["message"]
