"""The official `openai` client against a real `xlaserve serve` process running SmolLM2: chat and
completions, streamed and not, n=2, stop strings, seeded sampling, logprobs, and usage counts
that match the tokenizer's."""

from __future__ import annotations

import openai
import pytest

from tests.system.conftest import MODEL, make_token

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."   # SmolLM2-135M-Instruct's greedy answer


@pytest.fixture(scope="module")
def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.url + "/v1", api_key=make_token("openai-tests"),
                         max_retries=0, timeout=60)


def test_chat_greedy_paris_with_exact_usage_and_logprobs(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24,
                                       temperature=0, logprobs=True, top_logprobs=2)
    (choice,) = r.choices
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.model == "smollm2@135m-instruct"
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(FRANCE))
    # one logprob entry per sampled token, the end-of-turn token included
    entries = choice.logprobs.content
    assert r.usage.completion_tokens == len(entries) <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(e.token for e in entries).startswith(choice.message.content)
    assert entries[-1].token == tokenizer.eos_token
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        # greedy: the sampled token is the most likely one
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)


def test_chat_stream_matches_non_stream_and_counts_tokens(client, tokenizer):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24,
                                          temperature=0)
    text, tokens, finish, usage, roles = "", 0, None, None, []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=FRANCE, max_tokens=24, temperature=0, stream=True,
            logprobs=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            tokens += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
            finish = c.finish_reason or finish
    assert roles == ["assistant"]
    assert text == full.choices[0].message.content
    assert "Paris" in text and finish == "stop"
    assert usage is not None
    assert usage.prompt_tokens == len(tokenizer.encode_chat(FRANCE)) == full.usage.prompt_tokens
    assert usage.completion_tokens == tokens == full.usage.completion_tokens


def test_completions_stream_and_not_with_logprobs(client, tokenizer):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                     logprobs=2)
    (c,) = full.choices
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert "Paris" in c.text
    lp = c.logprobs
    assert full.usage.completion_tokens == len(lp.tokens) == len(lp.token_logprobs)
    assert len(lp.top_logprobs) == len(lp.tokens)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    if c.finish_reason == "length":  # no end-of-text token: the tokens spell the text
        assert full.usage.completion_tokens == 6
        assert "".join(lp.tokens) == c.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    text, streamed, usage = "", 0, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                           temperature=0, logprobs=0, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            text += ch.text
            streamed += len(ch.logprobs.tokens) if ch.logprobs else 0
    assert text == c.text
    assert usage.completion_tokens == streamed == full.usage.completion_tokens


def test_n2_greedy_choices_agree_and_usage_sums(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12,
                                       temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert "Paris" in r.choices[0].message.content
    one = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12,
                                         temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once
    assert r.usage.completion_tokens == 2 * one.usage.completion_tokens

    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=12,
                                                temperature=0, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}


def test_seed_reproducible_and_n2_choices_use_seed_plus_index(client):
    story = [{"role": "user", "content": "Tell me a short story about a cat."}]

    def sample(seed: int, n: int = 1) -> list[str]:
        r = client.chat.completions.create(model=MODEL, messages=story, max_tokens=16,
                                           temperature=0.8, seed=seed, n=n)
        return [c.message.content for c in r.choices]

    first = sample(1234)
    assert first == sample(1234)
    pair = sample(1234, n=2)
    assert pair[0] == first[0]
    assert pair[1] == sample(1235)[0]
    assert pair[0] != pair[1]   # different seeds: these two happen to differ (deterministic)


def test_stop_string_cuts_the_text(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24,
                                       temperature=0, stop=["Paris", "never-seen"])
    (c,) = r.choices
    assert c.finish_reason == "stop"
    assert "Paris" not in c.message.content
    assert c.message.content and PARIS.startswith(c.message.content)
    text = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24,
                                                temperature=0, stop="Paris", stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text == c.message.content


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids and "smollm2@135m-instruct" in ids


def test_logprob_bytes_spell_the_utf8_of_the_content(client):
    """OpenAI's `bytes` let a client rebuild characters split over several tokens."""
    r = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, logprobs=True,
        messages=[{"role": "user", "content": "Write the word café three times, with an emoji."}])
    content = r.choices[0].message.content
    assert any(ord(ch) > 0xFFFF for ch in content)  # an emoji: 4 bytes over several tokens
    raw = b"".join(bytes(e.bytes) for e in r.choices[0].logprobs.content)
    # (a character cut by max_tokens ends the content as U+FFFD, as a lenient decode does)
    assert raw.decode("utf-8", errors="replace").startswith(content)
