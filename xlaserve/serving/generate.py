"""`xlaserve generate`: one request through the serving engine, its text streamed as it comes.

The engine is the server's (serving/engine/factory.py `build_engines`, one replica holding one
sequence), so its sampler is the server's too: the same prompt, sampling parameters and seed
give the same text as `xlaserve serve` gives a request with that seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from xlaserve.serving.engine.engine import LLMEngine
from xlaserve.serving.engine.factory import build_engines, engine_config
from xlaserve.serving.types import GenerationRequest, SamplingParams


def single_request_engine(folder: str | Path, max_len: int, *, dtype: str | None = None,
                          attention_backend: str = "auto", block_size: int = 16) -> LLMEngine:
    """An engine over the model in `folder` for one sequence of up to `max_len` positions
    (rounded up to whole blocks); `generate_text` compiles the buckets its request uses."""
    max_model_len = -(-max_len // block_size) * block_size
    config = engine_config({"max_model_len": max_model_len, "block_size": block_size,
                            "num_kv_blocks": max_model_len // block_size + 1,
                            "max_num_seqs": 1, "max_num_batched_tokens": max_model_len,
                            "max_prefill_chunk": max_model_len,
                            "attention_backend": attention_backend})
    [engine] = build_engines(folder, config, dtype=dtype, warmup=False)
    return engine


def generate_text(engine: LLMEngine, prompt: list[int], sampling: SamplingParams
                  ) -> Iterator[str]:
    """The text of `prompt`'s continuation, delta by delta (stop tokens and strings as the
    server applies them: not part of the text)."""
    request = GenerationRequest("generate", list(prompt), sampling)
    engine.add(request)   # ValueError for a request that could never run
    engine.runner.warmup(single_sequence_shapes(engine, len(prompt)))
    for event in engine.run_until_done():
        if event.error:
            raise RuntimeError(f"generation failed: {event.error}")
        if event.text:
            yield event.text


def single_sequence_shapes(engine: LLMEngine, prompt_tokens: int) -> list[tuple[int, int, int]]:
    """The buckets one sequence of a `prompt_tokens` prompt runs in on `engine` (its prompt in
    one chunk, then decodes), every table width of them: two compiles where one width serves
    every step (the CPU kernels), a few more elsewhere; not the whole bucket plan."""
    buckets = engine.runner.buckets
    widths = buckets.table_widths
    return sorted({buckets.fit(1, n, w) for n in (1, prompt_tokens) for w in widths})
