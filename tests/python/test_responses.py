"""`POST /v1/responses` (OpenAI Responses) through the official `openai` client. Greedy
(`temperature=0`, reasoning effort `none`: thinking off), so stream and non-stream agree."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from conftest import SERVED_NAME

GREEDY: dict[str, Any] = {
    "model": SERVED_NAME,
    "instructions": "You are terse.",
    "input": [
        {"role": "user", "content": "Tell me about ünïcødé and 你好."},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Go on."},
    ],
    "max_output_tokens": 16,
    "temperature": 0,
    "reasoning": {"effort": "none"},
}


def test_responses_non_stream(client: openai.OpenAI, official) -> None:
    r = client.responses.create(**GREEDY)
    assert r.object == "response"
    assert r.model == SERVED_NAME
    assert r.id
    assert r.status in {"completed", "incomplete"}
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    messages = [o for o in r.output if o.type == "message"]
    assert messages, [o.type for o in r.output]
    assert not [o for o in r.output if o.type == "reasoning"], "effort none: no reasoning item"
    assert isinstance(r.output_text, str)
    assert r.usage.input_tokens == len(official.ids("responses", GREEDY))
    assert 1 <= r.usage.output_tokens <= GREEDY["max_output_tokens"]
    assert client.responses.create(**GREEDY).output_text == r.output_text


def test_responses_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.responses.create(**GREEDY)
    events = list(client.responses.create(**GREEDY, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] in {"response.completed", "response.incomplete"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.status == whole.status
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_responses_reasoning_item_when_thinking(client: openai.OpenAI) -> None:
    body = dict(GREEDY, reasoning={"effort": "high"})
    del body["temperature"]
    r = client.responses.create(**body)
    assert [o.type for o in r.output][0] == "reasoning", [o.type for o in r.output]


def test_responses_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**dict(GREEDY, temperature=5))
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**dict(GREEDY, input=[]))
    assert e.value.param == "input"
