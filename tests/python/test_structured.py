"""Structured outputs through the official `openai` client: a random model's answers still
follow the request's JSON schema, named tool call and regex, because the router's workers mask
every token the grammar forbids."""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest

from conftest import SERVED_NAME

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "level": {"type": "string", "enum": ["low", "medium", "high"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "active": {"type": "boolean"},
            },
            "required": ["id", "active"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "level", "tags", "owner"],
    "additionalProperties": False,
}


def follows_schema(doc: Any) -> bool:
    """SCHEMA's rules, checked by hand (no validator package in the test venv)."""
    if not isinstance(doc, dict) or set(doc) != {"name", "level", "tags", "owner"}:
        return False
    owner = doc["owner"]
    return (
        isinstance(doc["name"], str)
        and len(doc["name"]) <= 12
        and doc["level"] in ("low", "medium", "high")
        and isinstance(doc["tags"], list)
        and 1 <= len(doc["tags"]) <= 3
        and all(isinstance(t, str) and len(t) <= 6 for t in doc["tags"])
        and isinstance(owner, dict)
        and set(owner) == {"id", "active"}
        and isinstance(owner["id"], int)
        and not isinstance(owner["id"], bool)
        and 1 <= owner["id"] <= 999
        and isinstance(owner["active"], bool)
    )


def test_json_schema_answers_parse_and_validate(client: openai.OpenAI) -> None:
    for seed in range(50):
        r = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": f"Describe item {seed} as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "item", "schema": SCHEMA, "strict": True},
            },
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            extra_body={"thinking": {"type": "disabled"}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        doc = json.loads(choice.message.content)
        assert follows_schema(doc), choice.message.content


def test_a_named_tool_choice_gives_that_call_with_valid_arguments(client: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    }
    other = {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    }
    for seed in range(5):
        r = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[tool, other],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            extra_body={"thinking": {"type": "disabled"}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            args = json.loads(call.function.arguments)
            assert args["city"] in ("Paris", "Oslo", "Lima"), args
            assert 1 <= args["days"] <= 7, args


def test_auto_over_strict_tools_gives_text_or_valid_calls(client: openai.OpenAI, official) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                    "metric": {"type": "boolean"},
                },
                "required": ["city", "metric"],
                "additionalProperties": False,
            },
        },
    }
    # A random model rarely opens a tool-call block: the bias pushes it towards the block's
    # opening (a blank line, `<`, the tag token), which the grammar allows only in that order.
    tok = official.tokenizer
    ids = [*tok.encode("\n\n"), *tok.encode("<"), *tok.encode("｜DSML｜")]
    assert len(ids) == 3, ids
    calls = texts = 0
    for seed in range(6):
        r = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[tool],
            tool_choice="auto",
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            logit_bias={str(i): 30 for i in ids},
            extra_body={"thinking": {"type": "disabled"}},
        )
        choice = r.choices[0]
        if choice.message.tool_calls:
            calls += 1
            assert choice.finish_reason == "tool_calls", choice
            for call in choice.message.tool_calls:
                assert call.function.name == "get_weather"
                args = json.loads(call.function.arguments)
                assert set(args) == {"city", "metric"}, args
                assert args["city"] in ("Paris", "Oslo", "Lima") and isinstance(args["metric"], bool)
        else:
            texts += 1
            assert "DSML" not in (choice.message.content or ""), choice
    assert calls > 0, "no request called the tool"


def test_guided_regex_on_completions(client: openai.OpenAI) -> None:
    for seed in range(5):
        r = client.completions.create(
            model=SERVED_NAME,
            prompt="Code:",
            temperature=1.0,
            seed=seed,
            max_tokens=40,
            extra_body={"guided_regex": "[A-Z]{2}-[0-9]{4}"},
        )
        assert re.fullmatch("[A-Z]{2}-[0-9]{4}", r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"


def test_an_uncompilable_schema_is_a_400_with_the_reason(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "JSON please"}],
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "string", "format": "no-such-format"},
                },
            },
            max_tokens=20,
        )
    assert "no-such-format" in str(e.value)
