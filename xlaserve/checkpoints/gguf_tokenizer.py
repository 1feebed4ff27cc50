"""A GGUF file's vocabulary -> the tokenizer files of an xlaserve model folder.

    tokenizer.ggml.model == "gpt2"   byte-level BPE (Llama 3, SmolLM2, Qwen, ...) -> tokenizer.json
    tokenizer.ggml.model == "llama"  sentencepiece BPE (Llama 1/2, Mistral, TinyLlama, ...)
                                     -> tokenizer.model, rebuilt from the pieces, scores and types

Either way `tokenizer_config.json` gets the ids, the special tokens and the chat template, and
`serving/tokenizer.py` loads the folder like one converted from Hugging Face.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xlaserve.serving.tokenizer import TOKENIZER_CONFIG

# The pre-tokenizer regexes of llama.cpp (src/llama-vocab.cpp, by LLAMA_VOCAB_PRE_TYPE) in the
# spelling of the families' own tokenizer.json files; llama.cpp rewrites `(?i:...)` by hand as
# `'[sS]|...`, the same split.  Qwen2 and Llama 3 differ only in digits: one by one, or in
# groups of up to three.
_GPT4_STYLE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|{digits}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = _GPT4_STYLE.replace("{digits}", r"\p{N}{1,3}")
QWEN2_REGEX = _GPT4_STYLE.replace("{digits}", r"\p{N}")
# Mistral's tekken (Nemo, Small 3): words split at case changes, digits one by one
TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` family splits text before its merges."""
    regex: str | None          # split by this, then byte-level without its own regex
    split_digits: bool = False  # (regex None) digits one by one, then GPT-2's byte-level split
    ignore_merges: bool = False  # a word that is a whole token is that token (llama.cpp, HF)
    add_bos: bool = False       # llama.cpp's default when the file has no add_bos_token
    nfc: bool = False           # HF's tokenizer.json normalizes to NFC (llama.cpp does not)


_GPT2 = PreTokenizer(None)
_DIGITS = PreTokenizer(None, split_digits=True)
_LLAMA3 = PreTokenizer(LLAMA3_REGEX, ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer(QWEN2_REGEX, nfc=True)
# tokenizer.ggml.pre -> its pre-tokenizer (names as llama-vocab.cpp reads them); a file without
# the key is GPT-2's byte-level split, a name not here is refused at conversion.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion",
                     "granite-docling"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), _DIGITS),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer(LLAMA3_REGEX)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2),
    "tekken": PreTokenizer(TEKKEN_REGEX, ignore_merges=True, add_bos=True),
}


def pre_tokenizer_of(fields: dict[str, Any]) -> PreTokenizer:
    name = fields.get("tokenizer.ggml.pre")
    if name is None:
        return _GPT2
    if name not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre {name!r} is not supported (supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}); convert the HF checkpoint "
                         "instead")
    return PRE_TOKENIZERS[name]


# tokenizer.ggml.token_type values; llama.cpp took them from sentencepiece's piece types.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6
_SPECIAL_TYPES = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)

SUPPORTED_MODELS = ("gpt2", "llama")


def tokenizer_from_gguf(fields: dict[str, Any], folder: Path) -> None:
    """Write the tokenizer files into `folder` from a GGUF file's `tokenizer.*` fields."""
    kind = fields.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_MODELS)}); convert the HF checkpoint instead")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types = [int(t) for t in fields.get("tokenizer.ggml.token_type") or
             [TOKEN_TYPE_NORMAL] * len(tokens)]
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                         f"{len(tokens)} tokens")
    special = [t for t, ty in zip(tokens, types) if ty in _SPECIAL_TYPES]
    if kind == "gpt2":
        pre = pre_tokenizer_of(fields)
        _write_byte_level_bpe(fields, tokens, special, folder, pre)
        add_bos_default = pre.add_bos
    else:
        _write_sentencepiece(fields, tokens, types, folder)
        add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies

    def token(key: str) -> str | None:
        i = fields.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    # stop tokens: end of sequence, of turn (<|eot_id|>, <|im_end|>, <end_of_turn>) and of
    # message (Llama 3.1's <|eom_id|>, after a tool call)
    eos_ids = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if fields.get(k) is not None]
    index = {t: i for i, t in enumerate(tokens)}
    config = {
        "chat_template": fields.get("tokenizer.chat_template"),
        # named ones, as llama.cpp's converter writes them (tokenizer.chat_template.tool_use)
        "chat_templates": {str(n): fields[f"tokenizer.chat_template.{n}"]
                           for n in fields.get("tokenizer.chat_templates") or []
                           if f"tokenizer.chat_template.{n}" in fields},
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "eos_token_ids": sorted({int(i) for i in eos_ids}),
        "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "special_ids": [index[t] for t in special],
        "special_tokens": special,
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _write_byte_level_bpe(fields: dict[str, Any], tokens: list[str], special: list[str],
                          folder: Path, pre: PreTokenizer) -> None:
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=pre.ignore_merges))
    if pre.regex is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pre.regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), byte_level]) \
            if pre.split_digits else byte_level
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(folder / "tokenizer.json"))


def _write_sentencepiece(fields: dict[str, Any], tokens: list[str], types: list[int],
                         folder: Path) -> None:
    """A sentencepiece BPE model with the GGUF's pieces, scores and types, in id order.

    Sentencepiece's BPE merges the adjacent pair whose merged piece scores highest, which is
    what llama.cpp's tokenizer does with these same scores; the normalizer is Llama's: no
    Unicode normalization, spaces as U+2581, a dummy prefix space unless the GGUF says not."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    scores = [float(s) for s in fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    if len(scores) != len(tokens):
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for "
                         f"{len(tokens)} tokens")
    seen: set[str] = set()
    for i, t in enumerate(tokens):
        if t in seen:
            raise ValueError(f"tokenizer.ggml.tokens repeats the piece {t!r} (id {i})")
        seen.add(t)
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    if TOKEN_TYPE_UNKNOWN not in types:
        if unk is None or not 0 <= int(unk) < len(tokens):
            raise ValueError("a sentencepiece vocabulary needs an unknown token: no piece has "
                             "token_type 2 and tokenizer.ggml.unknown_token_id is "
                             f"{unk!r}")
        types = list(types)
        types[int(unk)] = TOKEN_TYPE_UNKNOWN

    model = pb.ModelProto()
    for piece, score, ty in zip(tokens, scores, types):
        p = model.pieces.add()
        p.piece, p.score = piece, score
        p.type = ty if TOKEN_TYPE_NORMAL <= ty <= TOKEN_TYPE_BYTE else TOKEN_TYPE_NORMAL
    spec = model.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = TOKEN_TYPE_BYTE in types
    spec.unk_id = types.index(TOKEN_TYPE_UNKNOWN)
    for name in ("bos", "eos", "pad"):
        i = fields.get(f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id")
        setattr(spec, f"{name}_id", int(i) if i is not None and 0 <= int(i) < len(tokens)
                else -1)
    norm = model.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    path = folder / "tokenizer.model"
    path.write_bytes(model.SerializeToString())

    import sentencepiece as spm

    try:  # fail at conversion, naming the file, rather than when the server starts
        spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise ValueError(f"the sentencepiece model rebuilt from the GGUF vocabulary does not "
                         f"load: {e}") from e
