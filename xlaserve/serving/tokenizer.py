"""Tokenizers: BPE vocabularies (`tokenizer.json`, via the `tokenizers` library) and sentencepiece
models (`tokenizer.model`), with the model's own chat template and an incremental detokenizer.

A checkpoint folder holds one of `tokenizer.json` / `tokenizer.model` plus
`tokenizer_config.json` ({chat_template, bos_token, eos_token, add_bos_token, ...}).  GGUF
vocabularies are turned into one of those at conversion time
(`checkpoints/gguf_tokenizer.py`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG = "tokenizer_config.json"
MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|tool_call|>", "<|python_tag|>",
           "<tool_call>", "</tool_call>", "<think>", "</think>")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(self, backend: Any, kind: str, config: dict[str, Any]):
        self._backend = backend
        self.kind = kind  # "bpe" (tokenizers library) or "sentencepiece"
        self.chat_template: str | None = config.get("chat_template")
        # a checkpoint's other named templates (transformers uses "tool_use" when tools are given)
        self.chat_templates: dict[str, str] = dict(config.get("chat_templates") or {})
        self.add_bos: bool = bool(config.get("add_bos_token", False))
        self.bos_token: str | None = config.get("bos_token")
        self.eos_token: str | None = config.get("eos_token")
        # what chat templates see as bos_token, eos_token, unk_token, pad_token
        self.special_tokens_map: dict[str, str] = {
            f"{k}_token": str(config[f"{k}_token"]) for k in ("bos", "eos", "unk", "pad")
            if config.get(f"{k}_token")}
        self.bos_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = config.get("eos_token_ids")
        if eos_ids is None:
            eos_ids = [self.token_to_id(self.eos_token)] if self.eos_token else []
        self.eos_ids: tuple[int, ...] = tuple(int(i) for i in eos_ids if i is not None)
        self.special_ids: frozenset[int] = frozenset(
            int(i) for i in config.get("special_ids", [])) | frozenset(self.eos_ids) | (
            frozenset([self.bos_id]) if self.bos_id is not None else frozenset())
        if kind == "bpe":   # the tokenizer's own special tokens, whatever the config says
            self.special_ids |= frozenset(
                int(i) for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # special tokens that open a tool call (Mistral's [TOOL_CALLS], Granite's
        # <|tool_call|>, ...) or a reasoning block: decoded as text even when special tokens
        # are skipped, so that the response parsers (http/tool_syntax.py) see them
        self.marker_ids: frozenset[int] = frozenset(
            i for i in map(self.token_to_id, MARKERS) if i is not None)
        specials = sorted(config.get("special_tokens", []), key=len, reverse=True)
        self._special_re = (re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")
                            if specials and kind == "sentencepiece" else None)

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        cfg_path = folder / TOKENIZER_CONFIG
        config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        if (folder / "tokenizer.model").exists():
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
            return cls(sp, "sentencepiece", config)
        if (folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer as HFTokenizer

            return cls(HFTokenizer.from_file(str(folder / "tokenizer.json")), "bpe", config)
        raise FileNotFoundError(f"{folder}: no tokenizer.model or tokenizer.json")

    # -- ids -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self.kind == "sentencepiece":
            return int(self._backend.get_piece_size())
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        if self.kind == "sentencepiece":
            i = self._backend.piece_to_id(token)
            return None if i == self._backend.unk_id() and token != self._backend.id_to_piece(i) \
                else int(i)
        i = self._backend.token_to_id(token)
        return None if i is None else int(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`.  Special-token strings in the text (as chat templates write them) map
        to their ids; a BOS is prepended when the model asks for one and it is not there."""
        if self.kind == "sentencepiece":
            ids: list[int] = []
            parts = self._special_re.split(text) if self._special_re else [text]
            for i, part in enumerate(parts):
                if not part:
                    continue
                if i % 2 == 1:  # a special token
                    ids.append(int(self._backend.piece_to_id(part)))
                else:
                    ids.extend(self._backend.encode(part))
        else:
            ids = list(self._backend.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos and self.bos_id is not None and (
                not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def to_json(self) -> str | None:
        """The `tokenizers` JSON of a BPE vocabulary (what grammar engines read); None for
        sentencepiece."""
        return self._backend.to_str() if self.kind == "bpe" else None

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (what OpenAI's logprob `bytes` carry): a
        byte-level token holding part of a character gives those bytes, not U+FFFD."""
        if self.kind == "sentencepiece":
            piece = str(self._backend.id_to_piece(int(token_id)))
        else:
            piece = self._backend.id_to_token(int(token_id)) or ""
        if int(token_id) in self.special_ids:
            return piece.encode("utf-8")
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # sentencepiece byte fallback
            return bytes([int(piece[3:5], 16)])
        if self.kind == "bpe" and all(ch in BYTE_DECODER for ch in piece):
            return bytes(BYTE_DECODER[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode("utf-8")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids or i in self.marker_ids]
            if self.marker_ids.intersection(ids):
                return self._decode_around_markers(ids)
        if self.kind == "sentencepiece":
            return str(self._backend.decode(ids))
        return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def _decode_around_markers(self, ids: list[int]) -> str:
        """The ids between marker tokens decoded as usual, each marker as its own text."""
        out: list[str] = []
        run: list[int] = []
        for i in [*ids, -1]:
            if i in self.marker_ids or i == -1:
                out.append(self.decode(run) if run else "")
                run = []
                if i != -1:
                    out.append(str(self._backend.id_to_piece(i) if self.kind == "sentencepiece"
                                   else self._backend.id_to_token(i)))
            else:
                run.append(i)
        return "".join(out)

    # -- chat ------------------------------------------------------------------------------

    @property
    def template_takes_tools(self) -> bool:
        """Does the chat template render a `tools` list itself (else the caller describes the
        tools in a system message: http/tools.py)?"""
        return any("tools" in t for t in (self.chat_template, self.chat_templates.get(
            "tool_use")) if t)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """The model's own Jinja template rendered as transformers renders it: `messages`,
        `tools` (None when none), `documents`, `add_generation_prompt`, the special tokens
        (`bos_token`, ...) and `template_kwargs` (a request's chat_template_kwargs, such as
        Qwen3's `enable_thinking`).  A template that refuses the conversation is a
        ValueError with its reason and any role the template never names."""
        from jinja2.exceptions import TemplateError

        template = self.chat_templates.get("tool_use") if tools else None
        template = template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        try:
            return _render_chat(template, {
                **self.special_tokens_map, **(template_kwargs or {}), "messages": messages,
                "tools": tools, "documents": None,
                "add_generation_prompt": add_generation_prompt})
        except TemplateError as e:
            roles = [r for r in dict.fromkeys(str(m.get("role")) for m in messages)
                     if f"'{r}'" not in template and f'"{r}"' not in template]
            unknown = "".join(f"; the template has no '{r}' role" for r in roles)
            raise ValueError(f"{e}{unknown}") from None

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The rendered conversation's ids.  No BOS is added: the template writes the one it
        wants (`{{ bos_token }}`), as transformers' apply_chat_template and vLLM tokenize."""
        return self.encode(self.apply_chat_template(messages, tools=tools,
                                                    template_kwargs=template_kwargs),
                           add_special_tokens=False)


def _make_byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable character -> the byte it stands for."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


BYTE_DECODER = _make_byte_decoder()  # a constant table


def _render_chat(template: str, context: dict[str, Any]) -> str:
    """Jinja as transformers sets it up for chat templates: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, `{% generation %}` blocks (rendered as their body), a
    `tojson` that keeps non-ASCII text, `raise_exception` and `strftime_now`."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols",
                                                    _generation_extension()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(context)


def _generation_extension() -> type:
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it
    for training masks): here it renders its body, nothing else."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return Generation


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of recent ids and emits only the text beyond what the window's prefix
    already produced, holding back while the tail ends in an incomplete UTF-8 sequence (U+FFFD).
    Seeding the window with the prompt's last ids keeps a leading space that sentencepiece would
    drop from a first token decoded alone.  The deltas concatenate to the full decode."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (at the end of the stream)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if not final and text.endswith("\ufffd"):
            return ""   # an incomplete character: wait for its next bytes
        if text.startswith(prefix):
            if len(text) == len(prefix):
                return ""
            delta = text[len(prefix):]
        else:
            # New ids rewrote the window's earlier text: e.g. the prompt ended inside a
            # character ("\ufffd") that the first generated token completes.  Emit everything
            # past the part both decodes agree on, so no text is ever lost.
            delta = text[len(os.path.commonprefix([prefix, text])):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta


def hf_stop_ids(src: Path, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids generation stops at: config.json's `eos_token_id`s (given), those of
    `generation_config.json` (Qwen2.5 stops at <|im_end|> and <|endoftext|>, Gemma at <eos> and
    <end_of_turn>, Phi-3 at <|endoftext|>, <|assistant|> and <|end|>), and the tokenizer's
    eos token, in that order, each once."""
    ids = [int(i) for i in eos_token_ids]
    gen_path = src / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids += [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    cfg_path = src / TOKENIZER_CONFIG
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        eos_token = cfg.get("eos_token")
        eos_token = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
        ids += [int(i) for i, v in (cfg.get("added_tokens_decoder") or {}).items()
                if eos_token is not None and v.get("content") == eos_token]
    return list(dict.fromkeys(ids))


def _post_processor_adds(path: Path, token: str | None) -> bool:
    """Does the tokenizer.json at `path` put `token` before an encoded text?"""
    if token is None or not path.exists():
        return False
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(path))
    i = tok.token_to_id(token)
    with_specials = tok.encode("a", add_special_tokens=True).ids
    without = tok.encode("a", add_special_tokens=False).ids
    return i is not None and with_specials[:1] == [i] and without[:1] != [i]


def _hf_templates(src: Path, hf_cfg: dict[str, Any]) -> dict[str, str]:
    """name -> chat template: tokenizer_config.json's `chat_template` (one, or a list of named
    ones), else chat_template.jinja; transformers 5's additional_chat_templates/*.jinja."""
    raw = hf_cfg.get("chat_template")
    if isinstance(raw, list):
        out = {str(t["name"]): str(t["template"]) for t in raw}
    else:
        out = {"default": raw} if raw else {}
    if "default" not in out and (src / "chat_template.jinja").exists():
        out["default"] = (src / "chat_template.jinja").read_text()
    for path in sorted((src / "additional_chat_templates").glob("*.jinja")):
        out.setdefault(path.stem, path.read_text())
    return out


def tokenizer_from_hf(src: Path, folder: Path, eos_token_ids: Sequence[int]) -> None:
    """Copy an HF tokenizer (tokenizer.model or tokenizer.json) and distil its config: the
    chat template (tokenizer_config.json's, else chat_template.jinja), the special tokens, and
    the stop ids (`hf_stop_ids`)."""
    import shutil

    names = [n for n in ("tokenizer.model", "tokenizer.json") if (src / n).exists()]
    if not names:
        raise FileNotFoundError(f"{src}: no tokenizer.model or tokenizer.json")
    for name in names:
        shutil.copy2(src / name, folder / name)
    hf_cfg: dict[str, Any] = {}
    if (src / TOKENIZER_CONFIG).exists():
        hf_cfg = json.loads((src / TOKENIZER_CONFIG).read_text())
    templates = _hf_templates(src, hf_cfg)

    def content(v: Any) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    specials = {int(i): v["content"] for i, v in (hf_cfg.get("added_tokens_decoder") or {}).items()
                if v.get("special")}   # id -> token
    kind_spm = (src / "tokenizer.model").exists()
    config = {
        "chat_template": templates.pop("default", None),
        "chat_templates": templates,
        **{f"{k}_token": content(hf_cfg.get(f"{k}_token")) for k in ("bos", "eos", "unk", "pad")},
        "eos_token_ids": hf_stop_ids(src, eos_token_ids),
        # sentencepiece Llama tokenizers add BOS unless told not to; a tokenizer.json may add
        # it in its post-processor without the config saying so (Llama 3)
        "add_bos_token": bool(hf_cfg["add_bos_token"]) if "add_bos_token" in hf_cfg
        else kind_spm or _post_processor_adds(src / "tokenizer.json",
                                              content(hf_cfg.get("bos_token"))),
        "special_ids": list(specials),
        "special_tokens": list(specials.values()),
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False))
