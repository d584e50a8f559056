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


def test_completions_logprobs_have_openais_shape(client: openai.OpenAI) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 12, "seed": 5, "logprobs": 3}
    whole = client.completions.create(**body)
    lp = whole.choices[0].logprobs
    assert lp is not None
    n = len(lp.tokens)
    # Every generated token is listed except an eos that ended the request.
    assert whole.usage.completion_tokens - 1 <= n <= whole.usage.completion_tokens
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(isinstance(t, str) for t in lp.tokens)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # The chosen token is at most as likely as the best alternative listed.
    assert all(x <= max(top.values()) + 1e-6 for x, top in zip(lp.token_logprobs, lp.top_logprobs))
    assert lp.text_offset[0] == 0
    assert all(a <= b for a, b in zip(lp.text_offset, lp.text_offset[1:]))

    # Streaming lists the same tokens, chunk by chunk.
    chunks = list(client.completions.create(**body, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_completions_echo_puts_the_prompt_first(client: openai.OpenAI) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 6, "seed": 5}
    plain = client.completions.create(**body).choices[0].text
    echoed = client.completions.create(**body, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    chunks = list(client.completions.create(**body, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain


def test_completions_echo_with_logprobs_lists_the_prompt_first(client: openai.OpenAI) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 6, "seed": 5, "logprobs": 2}
    plain = client.completions.create(**body).choices[0]
    whole = client.completions.create(**body, echo=True)
    choice = whole.choices[0]
    assert choice.text == PROMPT + plain.text
    lp = choice.logprobs
    assert lp is not None and plain.logprobs is not None
    n = whole.usage.prompt_tokens
    # OpenAI's shape: the prompt's tokens first, the first with no log-probability.
    assert len(lp.tokens) == n + len(plain.logprobs.tokens)
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0.0 for x in lp.token_logprobs[1:n])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:n])
    # A raw prompt has no BOS: its tokens' texts are the echoed prompt.
    assert "".join(lp.tokens[:n]) == PROMPT
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert lp.text_offset[n] == len(PROMPT)
    # The completion's part is the one the request without echo lists.
    assert lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == plain.logprobs.token_logprobs

    # Streamed: the echo chunk carries the prompt's part, then the same tokens follow.
    chunks = list(client.completions.create(**body, echo=True, stream=True))
    listed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert listed[0].tokens == lp.tokens[:n]
    assert [t for l in listed for t in l.tokens] == lp.tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_completions_return_token_ids(client: openai.OpenAI, official) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8, "seed": 3}
    whole = client.completions.create(**body, extra_body={"return_token_ids": True})
    extra = whole.choices[0].model_extra or {}
    assert extra["prompt_token_ids"] == official.tokenizer.encode(PROMPT)
    ids = extra["token_ids"]
    assert whole.usage.completion_tokens - 1 <= len(ids) <= whole.usage.completion_tokens
    # The ids are the text's own: the same seed without them gives the same text.
    assert client.completions.create(**body).choices[0].text == whole.choices[0].text
    chunks = list(
        client.completions.create(**body, stream=True, extra_body={"return_token_ids": True})
    )
    streamed = [i for c in chunks if c.choices for i in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed == ids
    firsts = [c for c in chunks if c.choices and "prompt_token_ids" in (c.choices[0].model_extra or {})]
    assert len(firsts) == 1
