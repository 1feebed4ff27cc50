"""Which grammar engine computes allowed-token masks fastest on our vocabulary: llguidance vs
outlines-core on one JSON schema, walking the same token sequence (a valid instance of the
schema, tokenized by the model's tokenizer) and timing each step's mask.

    python -m xlaserve.bench.grammar_mask --tokenizer MODEL_DIR [--repeat 5]

Prints per engine: grammar compile seconds, then per-token mask time (median, p90, max) and
the time to advance the state by one token.  Both write a packed int32 bitmask
[ceil(V/32)], the layout the sampler applies on device.  Used once to pick the engine
(BENCHMARKS.md, "Grammar engine"); xgrammar is not measured: it needs torch at serving time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["math", "engines", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
            "active": True}


def _stats(seconds: list[float]) -> str:
    ms = sorted(1e3 * s for s in seconds)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    return (f"median {statistics.median(ms):.3f} ms, mean {statistics.fmean(ms):.3f} ms, "
            f"p90 {p90:.3f} ms, max {ms[-1]:.3f} ms")


def bench_llguidance(tokenizer_json: str, eos: int, vocab: int, tokens: list[int],
                     repeat: int) -> dict[str, object]:
    import llguidance

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    masks, advances, compiles = [], [], []
    mask = np.zeros((vocab + 31) // 32, np.int32)
    for _ in range(repeat):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, grammar)
        compiles.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        for t in tokens:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            masks.append(time.perf_counter() - t0)
            assert (mask[t // 32] >> (t % 32)) & 1, f"token {t} not allowed"
            t0 = time.perf_counter()
            ok = m.consume_token(t)
            advances.append(time.perf_counter() - t0)
            assert ok, m.get_error()
        assert m.is_accepting()
    return {"tokenizer_s": tok_s, "compile_s": statistics.median(compiles),
            "mask": _stats(masks), "advance": _stats(advances),
            "mask_median_ms": 1e3 * statistics.median(masks)}


def _byte_vocab(tokenizer_json: str) -> dict[bytes, list[int]]:
    """token bytes -> ids for a byte-level BPE vocabulary (GPT-2's printable byte mapping)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    decoder = {chr(c): b for b, c in zip(bs, cs)}
    model = json.loads(tokenizer_json)
    out: dict[bytes, list[int]] = {}
    specials = {t["id"] for t in model.get("added_tokens", [])}
    for piece, i in model["model"]["vocab"].items():
        if i in specials:
            continue
        out.setdefault(bytes(decoder[c] for c in piece), []).append(i)
    return out


def bench_outlines(tokenizer_json: str, eos: int, vocab: int, tokens: list[int],
                   repeat: int) -> dict[str, object]:
    import outlines_core

    t0 = time.perf_counter()
    voc = outlines_core.Vocabulary(eos, _byte_vocab(tokenizer_json))
    tok_s = time.perf_counter() - t0
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    t0 = time.perf_counter()
    index = outlines_core.Index(regex, voc)
    compile_s = time.perf_counter() - t0
    masks, advances = [], []
    mask = np.zeros((vocab + 31) // 32, np.int32)
    for _ in range(repeat):
        g = outlines_core.Guide(index)
        for t in tokens:
            t0 = time.perf_counter()
            g.write_mask_into(mask.ctypes.data, mask.size, 4)
            masks.append(time.perf_counter() - t0)
            assert (mask[t // 32] >> (t % 32)) & 1, f"token {t} not allowed"
            t0 = time.perf_counter()
            g.advance(t, return_tokens=False)
            advances.append(time.perf_counter() - t0)
        assert g.is_finished()
    return {"tokenizer_s": tok_s, "compile_s": compile_s, "mask": _stats(masks),
            "advance": _stats(advances), "mask_median_ms": 1e3 * statistics.median(masks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="model folder with tokenizer.json")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    from tokenizers import Tokenizer

    folder = Path(args.tokenizer)
    tokenizer_json = (folder / "tokenizer.json").read_text()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    hf = Tokenizer.from_str(tokenizer_json)
    vocab = hf.get_vocab_size(with_added_tokens=True)
    eos = int(config["eos_token_ids"][0])
    tokens = hf.encode(json.dumps(INSTANCE, separators=(",", ":")),
                       add_special_tokens=False).ids
    print(f"vocabulary {vocab} tokens; the instance is {len(tokens)} tokens; "
          f"{args.repeat} walks per engine")
    for name, fn in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines)):
        r = fn(tokenizer_json, eos, vocab, tokens, args.repeat)
        print(f"{name:14s} tokenizer {r['tokenizer_s']:.2f} s, grammar compile "
              f"{r['compile_s'] * 1e3:.1f} ms; mask {r['mask']}; advance {r['advance']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
