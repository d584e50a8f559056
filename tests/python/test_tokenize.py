"""The router's prompt token ids (`POST /tokenize`, vLLM shape) against DeepSeek's official
Python converter and V4 encoder (`deepseek-recipe` from PyPI) for the same request body, and
`POST /detokenize` of those ids against the official rendered prompt string."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from conftest import SERVED_NAME

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Web search.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
]

TOOL_TURNS = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris for 3 days, and news about it?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "Two tools are needed.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "Paris news"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21 °C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "Nothing new."},
]

MULTI_TURN = [
    {"role": "system", "content": "You are a helpful assistant.\nAnswer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And times 3? 你好 ünïcødé 🙂"},
]

# (id, request body as sent to the router). The official converter gets the same body, except
# that `chat_template_kwargs.thinking` (a vLLM spelling the router maps onto DeepSeek's
# `thinking` field) is rewritten into `thinking` for it.
CONVERSATIONS: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"messages": [{"role": "user", "content": "Hello, who are you?"}]}),
    ("system-multi-turn", {"messages": MULTI_TURN}),
    ("thinking-off", {"messages": MULTI_TURN, "thinking": {"type": "disabled"}}),
    ("thinking-on", {"messages": MULTI_TURN, "thinking": {"type": "enabled"}}),
    ("kwargs-thinking-off", {"messages": MULTI_TURN, "chat_template_kwargs": {"thinking": False}}),
    ("effort-high", {"messages": MULTI_TURN, "reasoning_effort": "high"}),
    ("effort-max", {"messages": MULTI_TURN, "reasoning_effort": "max"}),
    ("effort-low", {"messages": MULTI_TURN, "reasoning_effort": "low"}),
    ("tools", {"messages": TOOL_TURNS, "tools": TOOLS}),
    ("tools-thinking-off", {"messages": TOOL_TURNS, "tools": TOOLS, "thinking": {"type": "disabled"}}),
    (
        "tools-required-thinking-off",
        {
            "messages": TOOL_TURNS[:2],
            "tools": TOOLS,
            "tool_choice": "required",
            "thinking": {"type": "disabled"},
        },
    ),
    (
        "past-reasoning",
        {
            "messages": [
                {"role": "user", "content": "Think, then answer: 17 * 3?"},
                {
                    "role": "assistant",
                    "content": "51",
                    "reasoning_content": "17 * 3 = 51.",
                },
                {"role": "user", "content": "Now 51 + 1?"},
                {"role": "assistant", "content": "52", "reasoning_content": "Add one: 52."},
                {"role": "user", "content": "Thanks."},
            ]
        },
    ),
    (
        "json-object",
        {
            "messages": [{"role": "user", "content": "Reply in JSON with a key `a`."}],
            "response_format": {"type": "json_object"},
        },
    ),
]


def official_body(body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    kwargs = out.pop("chat_template_kwargs", None)
    if kwargs and "thinking" in kwargs and "thinking" not in out:
        out["thinking"] = {"type": "enabled" if kwargs["thinking"] else "disabled"}
    return out


@pytest.mark.parametrize("body", [b for _, b in CONVERSATIONS], ids=[i for i, _ in CONVERSATIONS])
def test_tokenize_matches_official_encoder(router, official, max_model_len, body) -> None:
    body = dict(body, model=SERVED_NAME)
    reply = router.post("/tokenize", body)
    assert reply.status == 200, reply.body
    got = reply.json()
    assert set(got) >= {"count", "max_model_len", "tokens", "token_strs"}
    want = official.chat_ids(official_body(body))
    tokens = got["tokens"]
    first_diff = next(
        (i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want))
    )
    assert tokens == want, (
        f"router and official ids differ at index {first_diff} "
        f"(router {tokens[first_diff:first_diff + 8]}, official {want[first_diff:first_diff + 8]}; "
        f"lengths {len(tokens)} / {len(want)})"
    )
    assert got["count"] == len(tokens)
    assert got["max_model_len"] == max_model_len

    # The ids decode (special tokens kept) to exactly the official rendered prompt: the real
    # tokenizer is byte-level BPE and round-trips special tokens, so strings are compared too.
    decoded = router.post("/detokenize", {"model": SERVED_NAME, "tokens": tokens})
    assert decoded.status == 200, decoded.body
    assert decoded.json()["prompt"] == official.chat_prompt(official_body(body))


def test_tokenize_prompt_matches_official_tokenizer(router, official) -> None:
    text = "Hello <｜User｜> wörld 你好"
    reply = router.post("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert reply.status == 200, reply.body
    # The official tokenizer encodes with the full vocabulary and adds no BOS.
    assert reply.json()["tokens"] == official.tokenizer.encode(text)
