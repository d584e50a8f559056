"""`POST /v1/completions` (legacy, raw prompt) through the official `openai` client."""

from __future__ import annotations

import openai

from conftest import SERVED_NAME

PROMPT = "Once upon a time, in a land of ünïcødé and 你好,"


def test_completions_stream_equals_non_stream(client: openai.OpenAI, official) -> None:
    body = {
        "model": SERVED_NAME,
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0.7,
        "seed": 99,
    }
    whole = client.completions.create(**body)
    assert whole.object == "text_completion"
    assert whole.model == SERVED_NAME
    assert len(whole.choices) == 1
    choice = whole.choices[0]
    assert isinstance(choice.text, str)
    assert choice.finish_reason in {"stop", "length"}
    # A raw prompt: the tokenizer's ids, no chat template and no BOS.
    assert whole.usage.prompt_tokens == len(official.tokenizer.encode(PROMPT))
    assert 1 <= whole.usage.completion_tokens <= 16

    chunks = list(
        client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.text
    assert finish == [choice.finish_reason]
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )

    # Seeded: the same text again.
    assert client.completions.create(**body).choices[0].text == choice.text
