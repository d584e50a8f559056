"""`POST /v1/chat/completions` through the official `openai` client: response shapes,
streaming equal to non-streaming, reasoning content, tools, and prompt token counts equal to
the official Python encoder's."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from conftest import SERVED_NAME

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something about seeds, ünïcødé and 你好."},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}


def tool_conversation(arguments: Any) -> list[dict[str, Any]]:
    """user -> assistant tool call -> tool result (the assistant answers next)."""
    return [
        {"role": "user", "content": "What is the weather in Paris, in celsius?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
    ]


def extra(obj: Any, key: str) -> Any:
    """A field the openai types do not declare (e.g. `reasoning_content`)."""
    return (obj.model_extra or {}).get(key)


def tool_calls_of(message_calls: Any) -> list[tuple[str | None, str | None]]:
    return [(c.function.name, c.function.arguments) for c in (message_calls or [])]


def test_chat_non_stream_shape_and_usage(client: openai.OpenAI, official) -> None:
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 12, "seed": 7}
    r = client.chat.completions.create(**body)
    assert r.object == "chat.completion"
    assert r.model == SERVED_NAME
    assert r.id and isinstance(r.created, int)
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in {"stop", "length"}
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(official.chat_ids(body))
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def fold_stream(client: openai.OpenAI, body: dict[str, Any]):
    """Streams `body` and concatenates its deltas."""
    stream = client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks, "empty stream"
    for c in chunks:
        assert c.object == "chat.completion.chunk"
        assert c.model == SERVED_NAME
    first = chunks[0]
    assert first.choices and first.choices[0].delta.role == "assistant", first
    content, reasoning, finish = "", "", None
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for choice in c.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += extra(delta, "reasoning_content") or ""
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, ["", ""])
                if call.function and call.function.name:
                    slot[0] += call.function.name
                if call.function and call.function.arguments:
                    slot[1] += call.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    usage = chunks[-1].usage
    tool_calls = [tuple(calls[i]) for i in sorted(calls)]
    return content, reasoning, tool_calls, finish, usage


@pytest.mark.parametrize("thinking", [None, False], ids=["thinking-default", "thinking-off"])
def test_chat_stream_equals_non_stream(client: openai.OpenAI, thinking: bool | None) -> None:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": MESSAGES,
        "max_tokens": 16,
        "temperature": 0.7,
        "seed": 1234,
        "tools": [WEATHER_TOOL],
    }
    if thinking is not None:
        body["extra_body"] = {"chat_template_kwargs": {"thinking": thinking}}
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    content, reasoning, tool_calls, finish, usage = fold_stream(client, body)
    assert content == (message.content or "")
    assert reasoning == (extra(message, "reasoning_content") or "")
    assert tool_calls == tool_calls_of(message.tool_calls)
    assert finish == whole.choices[0].finish_reason
    assert usage is not None, "include_usage: the final chunk carries usage"
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    # Seeded: a second non-stream request is identical.
    again = client.chat.completions.create(**body).choices[0].message
    assert (again.content, extra(again, "reasoning_content")) == (
        message.content,
        extra(message, "reasoning_content"),
    )


def test_reasoning_content_follows_thinking_mode(client: openai.OpenAI, router) -> None:
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 8, "seed": 3}
    on = client.chat.completions.create(**body).choices[0].message
    assert "reasoning_content" in (on.model_extra or {}), on
    assert isinstance(extra(on, "reasoning_content"), str)

    off = client.chat.completions.create(
        **body, extra_body={"chat_template_kwargs": {"thinking": False}}
    ).choices[0].message
    assert extra(off, "reasoning_content") is None, off
    # The wire form: absent or null, never a string.
    raw = router.post(
        "/v1/chat/completions", dict(body, chat_template_kwargs={"thinking": False})
    )
    assert raw.status == 200, raw.body
    assert raw.json()["choices"][0]["message"].get("reasoning_content") is None


def test_reasoning_effort_not_accepted_lists_accepted_values(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED_NAME, messages=MESSAGES, max_tokens=4, reasoning_effort="medium"
        )
    assert e.value.status_code == 400
    assert e.value.param == "reasoning_effort"
    message = e.value.body["message"]
    assert "medium" in message
    for accepted in ("none", "low", "high", "max"):
        assert accepted in message, message


@pytest.mark.parametrize("effort", ["none", "low", "high", "max"])
def test_accepted_reasoning_efforts(client: openai.OpenAI, official, effort: str) -> None:
    body = {
        "model": SERVED_NAME,
        "messages": MESSAGES,
        "max_tokens": 4,
        "seed": 1,
        "reasoning_effort": effort,
    }
    r = client.chat.completions.create(**body)
    assert r.usage.prompt_tokens == len(official.chat_ids(body))
    has_reasoning = extra(r.choices[0].message, "reasoning_content") is not None
    assert has_reasoning == (effort != "none"), "`none` turns thinking off"


def test_tool_round_trip(client: openai.OpenAI, router, official) -> None:
    as_string = {
        "model": SERVED_NAME,
        "messages": tool_conversation(json.dumps({"city": "Paris", "unit": "c"})),
        "tools": [WEATHER_TOOL],
        "max_tokens": 8,
        "seed": 11,
    }
    r = client.chat.completions.create(**as_string)
    assert r.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    assert r.usage.prompt_tokens == len(official.chat_ids(as_string))

    # `arguments` as a JSON object instead of a JSON string: the same prompt. (The model's own
    # tool calls are not asserted: with random weights it does not make any.)
    as_object = dict(as_string, messages=tool_conversation({"city": "Paris", "unit": "c"}))
    r2 = client.chat.completions.create(**as_object)
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens

    def tokenize(body: dict[str, Any]) -> list[int]:
        reply = router.post("/tokenize", {k: v for k, v in body.items() if k != "max_tokens"})
        assert reply.status == 200, reply.body
        return reply.json()["tokens"]

    assert tokenize(as_object) == tokenize(as_string) == official.chat_ids(as_string)
