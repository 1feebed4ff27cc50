"""One warmed-up SmolLM2 engine runner shared by the engine tests (warm-up compiles every
bucket once; engines built on it share the compiled executables), and a tiny random model with
the SmolLM2 vocabulary for engine logic that needs no meaningful text (compiles in seconds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import init_params
from xlaserve.serving.engine import EngineConfig, LLMEngine
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import EngineEvent, GenerationRequest
from xlaserve.sharding.mesh import make_mesh

ROOT = Path(__file__).resolve().parents[3]

ENGINE_CONFIG = EngineConfig.from_args(max_model_len=1024, num_kv_blocks=1024, max_num_seqs=16,
                             max_num_batched_tokens=512, max_prefill_chunk=256, min_table_width=16)


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
    config = ENGINE_CONFIG.with_args(changes)
    return LLMEngine(model.params, model.config, model.tokenizer, model.mesh, config,
                     runner=warm.runner)


TINY_CONFIG = ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16, eos_token_ids=(2,))
TINY_ENGINE_CONFIG = EngineConfig.from_args(max_model_len=64, block_size=16, num_kv_blocks=32,
                                            max_num_seqs=4, max_num_batched_tokens=64,
                                            max_prefill_chunk=32, min_step_tokens=16,
                                            min_table_width=4)


@pytest.fixture(scope="session")
def warm_tiny(model_dir) -> LLMEngine:
    engine = LLMEngine(init_params(TINY_CONFIG, 0, scale=0.5), TINY_CONFIG,
                       Tokenizer.load(model_dir), make_mesh(), TINY_ENGINE_CONFIG)
    engine.runner.warmup()
    return engine


def new_tiny_engine(warm: LLMEngine, **changes) -> LLMEngine:
    """A fresh tiny engine on the shared warmed-up runner; `changes` to TINY_ENGINE_CONFIG."""
    config = TINY_ENGINE_CONFIG.with_args(changes)
    return LLMEngine(warm.runner.params, TINY_CONFIG, warm.tokenizer, warm.runner.mesh, config,
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


def step_until_verifying(engine: LLMEngine, rid: str, max_steps: int = 40) -> None:
    """Step (checking the scheduler's integrity each time) until the step in flight holds a
    verify row of `rid`: the moment to abort it mid-verification."""
    for _ in range(max_steps):
        engine.step()
        engine.scheduler.check_integrity()
        in_flight = engine.scheduler.in_flight
        if in_flight and any(r.request_id == rid and r.num_draft for r in in_flight[-1].rows):
            return
    pytest.fail(f"request {rid} never had a verify row in flight")


def run_joining(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 12
                ) -> tuple[dict[str, list[EngineEvent]], int]:
    """Requests r0.. of `prompts`: the first three start, the rest join while those decode;
    each request's events and the number of compilations meanwhile."""
    from xlaserve.serving.runner.compile_counter import CompileCounter

    with CompileCounter() as compiles:
        for i, ids in enumerate(prompts[:3]):
            engine.add(request(f"r{i}", ids, max_tokens=max_tokens, ignore_eos=True))
        engine.step()
        for i, ids in enumerate(prompts[3:], start=3):
            engine.add(request(f"r{i}", ids, max_tokens=max_tokens, ignore_eos=True))
        out = collect(engine)
    return out, compiles.count


def assert_joining_matches_alone(engine: LLMEngine, model_config: ModelConfig,
                                 engine_config: EngineConfig, seed: int) -> None:
    """Warm the engine up, run six staggered prompts (run_joining): nothing compiles, and each
    request gets the greedy tokens the same parameters, backend and KV cache dtype give it
    alone (SequenceGenerator)."""
    from xlaserve.serving.sequence_generator import SequenceGenerator

    engine.runner.warmup()
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, 49152, n)) for n in (5, 21, 40, 9, 33, 2)]
    out, compiled = run_joining(engine, prompts)
    assert compiled == 0, f"{compiled} compilations after warm-up"
    alone = SequenceGenerator(engine.runner.params, model_config, max_len=64,
                              attention_backend=engine.runner.backend,
                              kv_dtype=engine_config.kv_dtype)
    for i, ids in enumerate(prompts):
        want = list(alone.generate(ids, 12, stop_ids=()))
        assert tokens_of(out[f"r{i}"]) == want, i
