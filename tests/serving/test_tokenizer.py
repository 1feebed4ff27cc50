"""Tokenizers and the incremental detokenizer, on SmolLM2's byte-level BPE (from its GGUF)."""

from __future__ import annotations

import pytest

from xlaserve.serving.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! The scheduler runs every step.",
    "Crème brûlée à la française, naïve café, Ångström, Straße.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 🎉🚀 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵 done.",
    "  leading and   multiple   spaces\n\nnew lines\ttabs  ",
    "mixed 123 digits 4567 and symbols <>&% ∑∫√",
]


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.load(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    # Never half a character: no delta holds a replacement character.
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_with_prompt_context_keeps_spaces(tok: Tokenizer) -> None:
    prompt = tok.encode("The answer is")
    out = tok.encode(" forty two, café ☕ ok")
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.add(i) for i in out) + detok.flush()
    assert text == " forty two, café ☕ ok"


@pytest.mark.parametrize("rest", [" there, how are you", ""])
def test_prompt_ending_inside_a_character_loses_no_text(tok: Tokenizer, rest: str) -> None:
    ids = tok.encode("Hi 😀" + rest)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    assert tok.decode(ids[:cut]) == "Hi \ufffd"   # the prompt holds the emoji's first bytes
    detok = IncrementalDetokenizer(tok, ids[:cut])
    deltas = [detok.add(i) for i in ids[cut:]] + [detok.flush()]
    assert deltas[0] == "😀"                        # the first token completes it
    assert "".join(deltas) == "😀" + rest


def test_matches_transformers_gguf_tokenizer(tok: Tokenizer, gguf_file) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    for text in TEXTS[:5]:  # no digits: see below
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    # llama.cpp's "smollm" pre-tokenizer (like SmolLM2's own tokenizer.json) splits digits one
    # by one; transformers' GGUF loader does not, so we check the digits against the vocab.
    ids = tok.encode("2024")
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_template_and_specials(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>") == 1
    assert tok.eos_ids == (2,)
    assert tok.decode(ids).count("<|im_start|>") == 0  # specials are skipped when decoding


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_spell_the_text(tok: Tokenizer, text: str) -> None:
    """Each token's own bytes (a piece of a character included) concatenate to the UTF-8."""
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode("utf-8")


def test_template_jinja_as_transformers_sets_it_up(tok: Tokenizer) -> None:
    """`{% generation %}` blocks render their body, `tojson` takes transformers' arguments, the
    special tokens and `tools` (None when none) are defined, kwargs reach the template."""
    import copy

    t = copy.copy(tok)
    t.chat_template = ("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}"
                       "{% endfor %}{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True) }}"
                       "{{ tools is none }}{{ eos_token }}{{ flag }}")
    assert t.apply_chat_template([{"role": "user", "content": "x"}],
                                 template_kwargs={"flag": 7, "self": 1}) == \
        '[x]{"a": "é", "b": 1}True<|im_end|>7'


def test_marker_tokens_decode_as_text_in_sentencepiece(tmp_path) -> None:
    """A sentencepiece vocabulary with Mistral's [TOOL_CALLS] as a control piece (Mistral 7B
    v0.3's tokenizer.model): skipped specials stay skipped, the marker is decoded as its text
    so the tool-call parser sees it (http/tool_syntax.py)."""
    import json

    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text('{"name": "get_weather", "arguments": {"city": "Paris"}}\n' * 20
                      + "The weather in Paris is sunny.\n" * 20)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=320,
        model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        control_symbols=["[TOOL_CALLS]"], minloglevel=2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "special_ids": [1, 2, 3],
         "special_tokens": ["<s>", "</s>", "[TOOL_CALLS]"]}))
    tok = Tokenizer.load(tmp_path)
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    ids = tok.encode("[TOOL_CALLS]" + call)
    assert ids[:2] == [1, 3]                          # BOS, then the control piece
    assert tok.decode(ids) == "[TOOL_CALLS]" + call   # BOS skipped, the marker kept
    detok = IncrementalDetokenizer(tok, ids[:1])
    assert "".join(detok.add(i) for i in ids[1:]) + detok.flush() == "[TOOL_CALLS]" + call
