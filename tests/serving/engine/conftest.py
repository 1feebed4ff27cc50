"""One warmed-up SmolLM2 engine runner shared by the engine tests (warm-up compiles every
bucket once; engines built on it share the compiled executables)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from xlaserve.serving.engine import EngineConfig, LLMEngine
from xlaserve.serving.types import EngineEvent, GenerationRequest

ROOT = Path(__file__).resolve().parents[3]

ENGINE_CONFIG = EngineConfig(max_model_len=1024, num_kv_blocks=1024, max_num_seqs=16,
                             max_num_batched_tokens=512, max_prefill_chunk=256,
                             max_prefill_tokens=256, min_table_width=16)


@pytest.fixture(scope="session")
def warm_engine(smollm2) -> LLMEngine:
    engine = LLMEngine(smollm2.params, smollm2.config, smollm2.tokenizer, smollm2.mesh,
                       ENGINE_CONFIG)
    engine.runner.warmup()
    return engine


@pytest.fixture
def engine(warm_engine, smollm2) -> LLMEngine:
    """A fresh engine (empty scheduler) on the shared warmed-up runner."""
    return new_engine(warm_engine, smollm2)


def new_engine(warm: LLMEngine, model, **changes) -> LLMEngine:
    config = ENGINE_CONFIG.__class__(**{**ENGINE_CONFIG.__dict__, **changes})
    return LLMEngine(model.params, model.config, model.tokenizer, model.mesh, config,
                     runner=warm.runner)


@pytest.fixture(scope="session")
def corpus_ids(smollm2) -> list[int]:
    """Real text to cut prompts from: this repository's own documentation and code."""
    text = "\n".join(p.read_text() for p in sorted(ROOT.glob("xlaserve/**/*.py")))
    return smollm2.tokenizer.encode(text)


def prompt(corpus: list[int], rng: np.random.Generator, n: int) -> list[int]:
    start = int(rng.integers(0, len(corpus) - n))
    return corpus[start:start + n]


def collect(engine: LLMEngine, events: list[EngineEvent] | None = None
            ) -> dict[str, list[EngineEvent]]:
    out: dict[str, list[EngineEvent]] = {}
    for ev in engine.run_until_done():
        out.setdefault(ev.request_id, []).append(ev)
        if events is not None:
            events.append(ev)
    engine.scheduler.check_integrity()
    return out


def tokens_of(events: list[EngineEvent]) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


def text_of(events: list[EngineEvent]) -> str:
    return "".join(ev.text for ev in events)


def request(rid: str, ids: list[int], **sampling) -> GenerationRequest:
    from xlaserve.serving.types import SamplingParams

    sampling.setdefault("temperature", 0.0)
    return GenerationRequest(rid, list(ids), SamplingParams(**sampling))
