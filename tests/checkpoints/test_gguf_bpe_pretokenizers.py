"""Byte-level BPE vocabularies of Qwen2, Llama 3 and Mistral Nemo (tekken) through GGUF: a
tokenizer built here with the `tokenizers` library the way each family's tokenizer.json is (its
pre-tokenizer regex, HF's spelling; Qwen's NFC normalizer; Llama 3's and tekken's
ignore_merges), trained on a small corpus, written into a GGUF as llama.cpp's converter writes
one (`tokenizer.ggml.pre` naming the family), and converted by xlaserve: the same ids as the HF tokenizer on numbers, code and non-Latin text, and
the GGUF's chat template (Qwen2.5's, Llama 3.2's, Nemo's) rendered to the ids transformers gives."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from tests.chat_templates import LLAMA3_2, MISTRAL_NEMO, QWEN2_5
from tests.helpers import finish_gguf
from xlaserve.checkpoints.gguf_file import gguf_tokenizer_fields
from xlaserve.checkpoints.gguf_tokenizer import tokenizer_from_gguf
from xlaserve.serving.tokenizer import Tokenizer

# The pre_tokenizer Split patterns of Qwen/Qwen2.5-0.5B and meta-llama/Llama-3.2-1B
# tokenizer.json: they differ only in the digits (`\p{N}` against `\p{N}{1,3}`).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral Nemo's (tekken): case changes split words, digits one by one
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FAMILIES = {  # gguf pre name, split regex, NFC, ignore_merges, specials (bos, eos, other)
    "qwen2": ("qwen2", QWEN2_SPLIT, True, False, ["<|endoftext|>", "<|im_end|>",
                                                   "<|im_start|>"]),
    "llama3": ("llama-bpe", LLAMA3_SPLIT, False, True, [
        "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
        "<|end_header_id|>"]),
    "tekken": ("tekken", TEKKEN_SPLIT, False, True, ["<s>", "</s>", "[INST]", "[/INST]"]),
}
TEMPLATES = {"qwen2": QWEN2_5, "llama3": LLAMA3_2, "tekken": MISTRAL_NEMO}
TOOL_USE = "{{ tools | length }} tools"   # qwen2's named "tool_use" template
ADDS_BOS = ("llama3", "tekken")   # llama.cpp's default for these pre-tokenizers
TEXT = ("In 2024, 1234567 people paid $3.50 (or 1,000.25 EUR) on 2024-12-04T20:36:44Z.\n"
        "def square(x: int) -> int:\n    return x ** 2  # I'M SURE it's fine, they'LL see\n\n"
        "\tfor i in range(10_000): print(f\"{i:08d}\")\r\n"
        "中文分词测试：价格是 42 元。日本語のテキスト、東京タワー。한국어 문장입니다. "
        "Русский текст 123. العربية ٣٤٥ हिन्दी १२३ ελληνικά. caf" + "e\u0301 na\u00efve "
        "emoji \U0001F600\U0001F680 x\u200by   trailing   \n\n\n")
CORPUS = [TEXT, TEXT.lower(), TEXT.upper(), "0123456789 " * 20, "Hello world! " * 10,
          unicodedata.normalize("NFC", TEXT)]


def hf_tokenizer(family: str):
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, trainers

    _, split, nfc, ignore_merges, specials = FAMILIES[family]
    tok = HFTokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_gguf(tok, family: str, path: Path) -> None:
    """The vocabulary as llama.cpp's convert_hf_to_gguf writes a byte-level BPE one: tokens in
    id order, merges as "a b", specials CONTROL, `tokenizer.ggml.pre` the family's name."""
    import gguf

    pre, *_, specials = FAMILIES[family]
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(tok.to_str())["model"]["merges"]
    w = gguf.GGUFWriter(str(path), "qwen2" if family == "qwen2" else "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(vocab[specials[0]])
    w.add_eos_token_id(vocab[specials[1]])
    if family == "llama3":
        w.add_eot_token_id(vocab[specials[2]])
    # qwen2's with a named one too, as llama.cpp writes them
    w.add_chat_template([{"name": "default", "template": TEMPLATES[family]},
                         {"name": "tool_use", "template": TOOL_USE}]
                        if family == "qwen2" else TEMPLATES[family])
    finish_gguf(w)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory):
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    hf = hf_tokenizer(family)
    write_gguf(hf, family, folder / "vocab.gguf")
    (folder / "out").mkdir()
    tokenizer_from_gguf(gguf_tokenizer_fields(folder / "vocab.gguf"), folder / "out")
    return family, hf, Tokenizer.load(folder / "out")


def test_gguf_tokenization_equals_hf(converted) -> None:
    family, hf, ours = converted
    for text in (TEXT, *TEXT.splitlines(keepends=True), "12345", " 1 22 333 4444",
                 "<|im_start|>user\n99 bottles<|im_end|>"):
        want = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == want, (family, text)
        assert ours.decode(want) == hf.decode(want), (family, text)
    # the digit groups the fix is about: Llama 3 splits digits in threes, Qwen one by one
    words = [w for w, _ in ours._backend.pre_tokenizer.pre_tokenize_str("1234567")]
    assert words == (["123", "456", "7"] if family == "llama3" else list("1234567"))


def test_gguf_special_ids_and_bos(converted) -> None:
    family, hf, ours = converted
    _, *_, specials = FAMILIES[family]
    ids = [hf.token_to_id(t) for t in specials]
    if family in ADDS_BOS:   # llama.cpp adds BOS for these unless the file says not
        assert ours.add_bos and ours.encode("hi")[0] == ids[0]
    if family == "llama3":
        assert ours.eos_ids == (ids[1], ids[2])               # end_of_text and eot_id
    elif family == "qwen2":
        assert not ours.add_bos and ours.eos_ids == (ids[1],)


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'deepseek-llm' is not supported"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre":
                             "deepseek-llm", "tokenizer.ggml.tokens": ["a", "b"]}, tmp_path)


def test_gguf_chat_template_gives_transformers_ids(converted) -> None:
    """`tokenizer.chat_template` of the GGUF, rendered by xlaserve over the converted vocabulary:
    the ids transformers gives for the HF tokenizer with that template."""
    from transformers import PreTrainedTokenizerFast

    family, hf, ours = converted
    _, *_, specials = FAMILIES[family]
    ref = PreTrainedTokenizerFast(tokenizer_object=hf, bos_token=specials[0],
                                  eos_token=specials[2 if family == "llama3" else 1])
    ref.chat_template = TEMPLATES[family]
    msgs = [{"role": "system", "content": "Answer in 3 words."},
            {"role": "user", "content": "What is 1234 + 5678? 中文, русский."},
            {"role": "assistant", "content": "It is 6912."},
            {"role": "user", "content": "def f(x): return x ** 2 -- and f(12)?"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    assert ours.encode_chat(msgs) == list(want), family


def test_gguf_named_templates(converted) -> None:
    family, _, ours = converted
    if family == "qwen2":
        tools = [{"type": "function", "function": {"name": "f"}}]
        assert ours.apply_chat_template([{"role": "user", "content": "x"}], tools=tools) \
            == "1 tools"
