"""`n` > 1 through the official `openai` client: n choices, each the single-choice answer of
its own seed (the request's seed + its index), one usage for the request."""

from __future__ import annotations

import openai

from conftest import SERVED_NAME


def test_chat_n_gives_n_choices_of_consecutive_seeds(client: openai.OpenAI) -> None:
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 10,
        "temperature": 1.0,
        "extra_body": {"thinking": {"type": "disabled"}},
    }
    three = client.chat.completions.create(**body, n=3, seed=20)
    assert [c.index for c in three.choices] == [0, 1, 2]
    completion = 0
    for i, choice in enumerate(three.choices):
        one = client.chat.completions.create(**body, seed=20 + i)
        assert one.choices[0].message.content == choice.message.content
        completion += one.usage.completion_tokens
    assert three.usage.completion_tokens == completion
    assert three.usage.total_tokens == three.usage.prompt_tokens + completion

    chunks = list(
        client.chat.completions.create(
            **body, n=3, seed=20, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = ["", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content or "" for c in three.choices]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1
    assert usages[0].completion_tokens == completion


def test_completions_n_and_best_of(client: openai.OpenAI) -> None:
    body = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 8, "seed": 3}
    three = client.completions.create(**body, n=3, best_of=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    for i, choice in enumerate(three.choices):
        assert client.completions.create(**{**body, "seed": 3 + i}).choices[0].text == choice.text
    try:
        client.completions.create(**body, n=2, best_of=4)
    except openai.BadRequestError as e:
        assert e.body["param"] == "best_of"
    else:
        raise AssertionError("best_of > n was accepted")


def test_chat_return_token_ids(client: openai.OpenAI) -> None:
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "seed": 4,
        "extra_body": {"thinking": {"type": "disabled"}, "return_token_ids": True, "ignore_eos": True},
    }
    whole = client.chat.completions.create(**body)
    dumped = whole.model_dump()
    assert len(dumped["prompt_token_ids"]) == whole.usage.prompt_tokens
    assert len(dumped["choices"][0]["token_ids"]) == 6
    streamed = [c.model_dump() for c in client.chat.completions.create(**body, stream=True)]
    assert streamed[0]["prompt_token_ids"] == dumped["prompt_token_ids"]
    ids = [i for c in streamed for choice in c["choices"] for i in choice.get("token_ids") or []]
    assert ids == dumped["choices"][0]["token_ids"]
