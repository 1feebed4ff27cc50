"""`bench online --dataset`: the request shapes of `vllm bench serve --dataset-name`, built
from the fixed corpus (no download), as text prompts of known token length.

    random             input  ~ U[in*(1-r), in*(1+r)]   (--random-input-len in, --random-range-
                       output ~ U[out*(1-r), out*(1+r)]  ratio r, --random-output-len out), after
                       a prefix of --random-prefix-len tokens that every request shares
    sharegpt-like      ShareGPT-shaped chat turns: lognormal prompt (median 100, sigma 1.0) and
                       output (median 128, sigma 0.9) lengths, kept like vLLM's ShareGPT loader
                       keeps conversations: prompt in [4, 1024], output >= 4, prompt + output
                       <= 2048; --sharegpt-output-len fixes every output
    prefix-repetition  --prefix-repetition-num-prefixes distinct prefixes of -prefix-len tokens,
                       each followed by a distinct suffix of -suffix-len tokens, output
                       -output-len; num_prompts // num_prefixes requests per prefix, shuffled

    DatasetOptions + tokenizer + seed + num_prompts --build_dataset--> [TextRequest]

Prompts are windows of the corpus token ids (the served model's tokenizer with --tokenizer,
else one "token" per corpus word, see online.CorpusWords), decoded to text; vLLM draws random
token ids instead, so lengths agree with vLLM's and the text reads as prose.  Each request's
`prompt_tokens` is that window's length (vLLM's `prompt_len`, the `input_lens` of its result).
The defaults are vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from xlaserve.bench.corpus import CORPUS
from xlaserve.bench.stream_client import TextRequest

if TYPE_CHECKING:
    from xlaserve.serving.tokenizer import Tokenizer


class TokenCodec(Protocol):   # the Tokenizer, or online.CorpusWords standing in for it
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


DATASETS = ("random", "sharegpt-like", "prefix-repetition")
ALIASES = {"prefix_repetition": "prefix-repetition", "sharegpt_like": "sharegpt-like"}
IGNORES_EOS = ("random",)    # vLLM sets ignore_eos for these: outputs run to their length


@dataclass(frozen=True)
class DatasetOptions:
    name: str = "random"
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128

    def __post_init__(self) -> None:
        name = ALIASES.get(self.name, self.name)
        if name not in DATASETS:
            raise ValueError(f"--dataset {self.name!r}: choose from {', '.join(DATASETS)}")
        object.__setattr__(self, "name", name)
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio {self.random_range_ratio} must be in "
                             "[0, 1)")
        for flag, value, least in (
                ("--random-input-len", self.random_input_len, 1),
                ("--random-output-len", self.random_output_len, 1),
                ("--random-prefix-len", self.random_prefix_len, 0),
                ("--sharegpt-output-len", self.sharegpt_output_len or 1, 1),
                ("--prefix-repetition-prefix-len", self.prefix_repetition_prefix_len, 0),
                ("--prefix-repetition-suffix-len", self.prefix_repetition_suffix_len, 1),
                ("--prefix-repetition-num-prefixes", self.prefix_repetition_num_prefixes, 1),
                ("--prefix-repetition-output-len", self.prefix_repetition_output_len, 1)):
            if value < least:
                raise ValueError(f"{flag} {value} must be >= {least}")


class _Corpus:
    """Windows of the corpus token ids, at seeded random offsets."""

    def __init__(self, codec: TokenCodec, longest: int, rng: np.random.Generator):
        self.base = codec.encode(CORPUS, add_special_tokens=False)
        ids = self.base
        while len(ids) < len(self.base) + longest:   # a window may start anywhere in base
            ids = ids + self.base
        self.ids, self.rng = ids, rng

    def window(self, n: int, start: int | None = None) -> list[int]:
        at = int(self.rng.integers(0, len(self.base))) if start is None else start
        return self.ids[at:at + n]


def _uniform_lens(rng: np.random.Generator, n: int, mean: int, ratio: float) -> np.ndarray:
    """[n] ints uniform in [floor(mean*(1-ratio)), ceil(mean*(1+ratio))], at least 1."""
    lo, hi = max(1, int(np.floor(mean * (1 - ratio)))), max(1, int(np.ceil(mean * (1 + ratio))))
    return rng.integers(lo, hi + 1, n)


def _random(o: DatasetOptions, corpus: _Corpus, n: int) -> list[tuple[list[int], int]]:
    rng = corpus.rng
    prefix = corpus.window(o.random_prefix_len) if o.random_prefix_len else []
    inputs = _uniform_lens(rng, n, o.random_input_len, o.random_range_ratio)
    outputs = _uniform_lens(rng, n, o.random_output_len, o.random_range_ratio)
    return [(prefix + corpus.window(int(p)), int(m)) for p, m in zip(inputs, outputs)]


def _sharegpt_like(o: DatasetOptions, corpus: _Corpus, n: int) -> list[tuple[list[int], int]]:
    rng = corpus.rng
    prompts = np.clip(np.rint(100 * np.exp(1.0 * rng.standard_normal(n))), 4, 1024)
    outputs = np.rint(128 * np.exp(0.9 * rng.standard_normal(n)))
    if o.sharegpt_output_len is not None:
        outputs = np.full(n, o.sharegpt_output_len)
    outputs = np.clip(outputs, 4, np.maximum(4, 2048 - prompts))
    return [(corpus.window(int(p)), int(m)) for p, m in zip(prompts, outputs)]


def _prefix_repetition(o: DatasetOptions, corpus: _Corpus, n: int
                       ) -> list[tuple[list[int], int]]:
    k = o.prefix_repetition_num_prefixes
    if n < k:
        raise ValueError(f"--num-prompts {n} is fewer than --prefix-repetition-num-prefixes "
                         f"{k}: every prefix needs a request")
    if k > len(corpus.base):
        raise ValueError(f"--prefix-repetition-num-prefixes {k}: the corpus has only "
                         f"{len(corpus.base)} distinct starting points")
    starts = corpus.rng.choice(len(corpus.base), size=k, replace=False)   # distinct prefixes
    prefixes = [corpus.window(o.prefix_repetition_prefix_len, int(s)) for s in starts]
    out = [(p + corpus.window(o.prefix_repetition_suffix_len), o.prefix_repetition_output_len)
           for p in prefixes for _ in range(n // k)]
    order = corpus.rng.permutation(len(out))
    return [out[i] for i in order]


_BUILDERS: dict[str, Callable[[DatasetOptions, _Corpus, int], list[tuple[list[int], int]]]] = {
    "random": _random, "sharegpt-like": _sharegpt_like, "prefix-repetition": _prefix_repetition}


def _longest(o: DatasetOptions) -> int:
    return {"random": o.random_prefix_len + int(np.ceil(o.random_input_len
                                                        * (1 + o.random_range_ratio))),
            "sharegpt-like": 1024,
            "prefix-repetition": o.prefix_repetition_suffix_len}[o.name]


def build_dataset(options: DatasetOptions, codec: TokenCodec | Tokenizer, seed: int,
                  num_prompts: int) -> list[TextRequest]:
    """`num_prompts` requests of the dataset (prefix-repetition: the largest multiple of its
    prefix count not above it), the same for the same seed."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts {num_prompts} must be >= 1")
    corpus = _Corpus(codec, max(_longest(options), options.prefix_repetition_prefix_len),
                     np.random.default_rng(seed))
    shapes = _BUILDERS[options.name](options, corpus, num_prompts)
    return [TextRequest(f"{options.name}-{i}", codec.decode(ids), m, prompt_tokens=len(ids))
            for i, (ids, m) in enumerate(shapes)]


def describe(options: DatasetOptions, requests: list[TextRequest]) -> dict[str, int | str]:
    p = [r.prompt_tokens or 0 for r in requests]
    o = [r.max_tokens for r in requests]
    return {"name": options.name, "num_requests": len(requests), "prompt_tokens": sum(p),
            "prompt_min": min(p), "prompt_max": max(p), "output_tokens": sum(o),
            "output_min": min(o), "output_max": max(o)}
