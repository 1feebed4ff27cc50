"""Named offline workloads: a seeded list of (prompt token ids, exact output length) pairs.

    WORKLOADS["mixed"].build(tokenizer, seed) -> Workload
        prompt lengths   log-uniform in [prompt_min, prompt_max], windows of the fixed corpus
        output lengths   lognormal(output_median, output_sigma) rounded, clipped to
                         [output_min, output_max]: most short, a few long
        arrivals         all at time 0 (offline throughput)

Every system is asked for exactly `num_output_tokens` tokens per request (EOS ignored), so they
all do the same work.  The first request is pinned to the longest prompt and the longest output,
the second to the shortest of both, so the extremes are always exercised.  Add a workload by
adding a `WorkloadSpec` to `WORKLOADS`; it also says which engine configuration suits it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from xlaserve.bench.corpus import CORPUS

if TYPE_CHECKING:  # the CLI lists workloads without importing the engine (and jax)
    from xlaserve.serving.engine.config import EngineConfig
    from xlaserve.serving.tokenizer import Tokenizer


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int          # generated exactly, whatever the model samples


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    requests: tuple[BenchRequest, ...]

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    def describe(self) -> dict[str, int | str]:
        p = [len(r.prompt_token_ids) for r in self.requests]
        o = [r.num_output_tokens for r in self.requests]
        return {"name": self.name, "seed": self.seed, "num_requests": len(self.requests),
                "prompt_tokens": sum(p), "prompt_min": min(p), "prompt_max": max(p),
                "output_tokens": sum(o), "output_min": min(o), "output_max": max(o)}


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str
    num_requests: int
    prompt_min: int
    prompt_max: int
    output_min: int
    output_max: int
    output_median: float
    output_sigma: float
    # engine shape for this workload (see engine_config)
    max_num_seqs: int = 32
    prefill_chunk: int = 256
    block_size: int = 16
    # the prompt is its corpus window then the window's first quarter again, so the model
    # goes on copying the text (editing / repeating a given text: prompt lookup's case)
    repeat: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(f"workload {self.name}: prompt lengths [{self.prompt_min}, "
                             f"{self.prompt_max}] are not a range of positive ints")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError(f"workload {self.name}: output lengths [{self.output_min}, "
                             f"{self.output_max}] are not a range of positive ints")

    def build(self, tokenizer: Tokenizer, seed: int = 0,
              num_requests: int | None = None) -> Workload:
        n = self.num_requests if num_requests is None else num_requests
        if n < 1:
            raise ValueError(f"num_requests={n} must be >= 1")
        corpus = tokenizer.encode(CORPUS, add_special_tokens=False)
        while len(corpus) < 2 * self.prompt_max:   # windows may start anywhere
            corpus = corpus + corpus
        rng = np.random.default_rng(seed)
        lo, hi = np.log(self.prompt_min), np.log(self.prompt_max + 1)
        prompt_lens = np.minimum(np.exp(rng.uniform(lo, hi, n)).astype(int), self.prompt_max)
        outputs = np.rint(self.output_median * np.exp(self.output_sigma * rng.standard_normal(n)))
        outputs = np.clip(outputs, self.output_min, self.output_max).astype(int)
        prompt_lens[0], outputs[0] = self.prompt_max, self.output_max
        if n > 1:
            prompt_lens[1], outputs[1] = self.prompt_min, self.output_min
        requests = []
        for i, (p, m) in enumerate(zip(prompt_lens, outputs)):
            start = int(rng.integers(0, len(corpus) - p))
            ids = corpus[start:start + p]
            if self.repeat:
                ids = ids + corpus[:1] + ids[: p // 4]
            requests.append(BenchRequest(f"{self.name}-{i}", tuple(ids), int(m)))
        return Workload(self.name, seed, tuple(requests))

    @property
    def max_model_len(self) -> int:
        longest = self.prompt_max + (1 + self.prompt_max // 4 if self.repeat else 0)
        return _round_up(longest + self.output_max, self.block_size)

    def engine_config(self, batch: int = 1) -> EngineConfig:
        """An engine sized for this workload whose runner also serves static batches of
        `batch` rows: every running sequence fits its longest length in the pool."""
        from xlaserve.serving.engine.config import EngineConfig

        seqs = max(self.max_num_seqs, _pow2_at_least(batch))
        chunk = min(self.prefill_chunk, _pow2_at_least(self.prompt_max))
        blocks_per_seq = self.max_model_len // self.block_size
        return EngineConfig.from_args(
            max_model_len=self.max_model_len, block_size=self.block_size,
            num_kv_blocks=seqs * blocks_per_seq + 1, max_num_seqs=seqs,
            max_num_batched_tokens=max(2 * chunk, seqs + 1), max_prefill_chunk=chunk,
            min_step_tokens=min(16, chunk), min_table_width=min(16, blocks_per_seq),
            enable_prefix_caching=True, pipelined=True)


WORKLOADS: dict[str, WorkloadSpec] = {
    spec.name: spec for spec in (
        WorkloadSpec("mixed", "64 requests at once, prompts 16-512 tokens, outputs long-tailed "
                     "1-256 tokens", num_requests=64, prompt_min=16, prompt_max=512,
                     output_min=1, output_max=256, output_median=24.0, output_sigma=1.2),
        WorkloadSpec("chat", "96 chat turns, prompts 24-300 tokens (+ the chat template: "
                     "~14.8k prompt tokens for SmolLM2), outputs 8-160 (~5.2k): prefill-heavy",
                     num_requests=96, prompt_min=24, prompt_max=300, output_min=8,
                     output_max=160, output_median=48.0, output_sigma=0.6),
        WorkloadSpec("lookup", "16 requests, a 128-512 token text of the corpus, a newline and "
                     "its first quarter again (the model goes on copying it), outputs 64-128",
                     num_requests=16, prompt_min=128, prompt_max=512, output_min=64,
                     output_max=128, output_median=96.0, output_sigma=0.3, repeat=True),
        WorkloadSpec("tiny", "4 requests, prompts 8-40 tokens, outputs 1-12 (tests)",
                     num_requests=4, prompt_min=8, prompt_max=40, output_min=1,
                     output_max=12, output_median=4.0, output_sigma=1.0, max_num_seqs=4,
                     prefill_chunk=16),
    )
}


def get_workload(name: str) -> WorkloadSpec:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
