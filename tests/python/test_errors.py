"""Errors as the official `openai` client sees them: status, exception class, and the OpenAI
error object (`message`, `type`, `param`, `code`)."""

from __future__ import annotations

import openai
import pytest

from conftest import API_KEY, SERVED_NAME

HELLO = [{"role": "user", "content": "Hello"}]


def test_malformed_json_is_an_openai_error_object(router) -> None:
    r = router.post("/v1/chat/completions", b'{"model": "deepseek-v4-flash", "messages": [')
    assert r.status == 400
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=4)
    assert e.value.status_code == 400
    assert "no-such-model" in e.value.body["message"]
    assert e.value.param == "model"


def test_empty_messages(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED_NAME, messages=[], max_tokens=4)
    assert e.value.param == "messages"


def test_temperature_out_of_range(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED_NAME, messages=HELLO, max_tokens=4, temperature=5
        )
    assert e.value.param == "temperature"
    assert "temperature" in e.value.body["message"]


def test_max_tokens_beyond_context(client: openai.OpenAI, max_model_len: int) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED_NAME, messages=HELLO, max_tokens=max_model_len + 1
        )
    assert e.value.param == "max_tokens"
    assert e.value.code == "context_length_exceeded"
    assert str(max_model_len) in e.value.body["message"]


def test_api_key_required(keyed_router) -> None:
    base = f"{keyed_router.url}/v1"
    wrong = openai.OpenAI(base_url=base, api_key="wrong-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=SERVED_NAME, messages=HELLO, max_tokens=2)
    wrong.close()

    # No key at all (the client cannot send that).
    r = keyed_router.post(
        "/v1/chat/completions", {"model": SERVED_NAME, "messages": HELLO, "max_tokens": 2}
    )
    assert r.status == 401
    assert r.json()["error"]["type"] == "authentication_error"
    # Health stays outside the key check.
    assert keyed_router.get("/health").status == 200

    right = openai.OpenAI(base_url=base, api_key=API_KEY, max_retries=0, timeout=60)
    assert SERVED_NAME in [m.id for m in right.models.list()]
    r = right.chat.completions.create(model=SERVED_NAME, messages=HELLO, max_tokens=2, seed=1)
    assert r.choices[0].finish_reason in {"stop", "length"}
    right.close()
