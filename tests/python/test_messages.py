"""`POST /v1/messages` (Anthropic Messages) through the official `anthropic` client.

The Messages API has no `seed`: determinism comes from `temperature=0` (with thinking off
here; the router honours it in thinking mode too, where the official converter alone would
sample at temperature 1.0). This `anthropic` release has no `temperature` argument any more,
so it travels in `extra_body` (the router reads it)."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from conftest import API_KEY, SERVED_NAME

BODY: dict[str, Any] = {
    "model": SERVED_NAME,
    "max_tokens": 16,
    "thinking": {"type": "disabled"},
    "system": "You are terse.",
    "messages": [
        {"role": "user", "content": "Tell me about ünïcødé and 你好."},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]},
    ],
}
# The keyword arguments of a greedy request, and its JSON body.
GREEDY: dict[str, Any] = dict(BODY, extra_body={"temperature": 0})
GREEDY_BODY: dict[str, Any] = dict(BODY, temperature=0)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_messages_non_stream(anthropic_client: anthropic.Anthropic, official) -> None:
    m = anthropic_client.messages.create(**GREEDY)
    assert m.type == "message"
    assert m.role == "assistant"
    assert m.model == SERVED_NAME
    assert m.id
    assert m.content, "at least one content block"
    assert {b.type for b in m.content} <= {"text"}, "thinking off: text blocks only"
    assert m.stop_reason in {"end_turn", "max_tokens"}
    assert m.usage.input_tokens == len(official.ids("messages", GREEDY_BODY))
    assert 1 <= m.usage.output_tokens <= GREEDY["max_tokens"]
    # Greedy: the same answer again.
    assert text_of(anthropic_client.messages.create(**GREEDY)) == text_of(m)


def test_messages_stream_equals_non_stream(anthropic_client: anthropic.Anthropic) -> None:
    whole = anthropic_client.messages.create(**GREEDY)
    with anthropic_client.messages.stream(**GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(whole)
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens

    # The raw event sequence of `stream=True`.
    events = list(anthropic_client.messages.create(**GREEDY, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "message_delta" in kinds
    assert "".join(
        e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
    ) == text_of(whole)


def test_messages_thinking_blocks(anthropic_client: anthropic.Anthropic, official) -> None:
    body = dict(BODY, thinking={"type": "enabled", "budget_tokens": 1024})
    m = anthropic_client.messages.create(**body)
    assert m.content and m.content[0].type == "thinking", [b.type for b in m.content]
    block = m.content[0]
    assert isinstance(block.thinking, str)
    assert isinstance(block.signature, str)
    assert m.usage.input_tokens == len(official.ids("messages", body))


def test_messages_bad_request(anthropic_client: anthropic.Anthropic, router) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=SERVED_NAME, max_tokens=8, messages=[])
    assert e.value.status_code == 400
    # The Anthropic error body.
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages" in e.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(**BODY, extra_body={"temperature": 1.5})  # Anthropic: [0, 1]

    r = router.post("/v1/messages", b'{"model": ')
    assert r.status == 400
    assert r.json()["type"] == "error"


def test_messages_api_key(keyed_router) -> None:
    """Anthropic clients send `x-api-key`, not `Authorization: Bearer`."""
    wrong = anthropic.Anthropic(base_url=keyed_router.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**GREEDY)
    wrong.close()
    right = anthropic.Anthropic(base_url=keyed_router.url, api_key=API_KEY, max_retries=0)
    assert right.messages.create(**GREEDY).type == "message"
    right.close()
