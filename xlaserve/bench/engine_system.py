"""System (a): the continuous-batching LLMEngine, every request added at time 0.

    warm-up (untimed): runner.warmup() compiles every bucket; one short request runs through a
                       throwaway engine on the same runner (first-call host work)
    timed:             add all requests; step() until done; a request completes with its final
                       event; KV waste sampled from the scheduler's KV usage after every step
"""

from __future__ import annotations

import time

from xlaserve.bench.metrics import Clock, KVWasteMeter, RequestOutcome, SystemResult
from xlaserve.bench.workload import BenchRequest, Workload
from xlaserve.serving.engine import EngineConfig, LLMEngine
from xlaserve.serving.loading import LoadedModel
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.runner.draft_runner import DraftRunner
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.types import GenerationRequest, SamplingParams


def new_engine(model: LoadedModel, config: EngineConfig, runner: ModelRunner,
               draft_runner: DraftRunner | None = None) -> LLMEngine:
    return LLMEngine(model.params, model.config, model.tokenizer, model.mesh, config,
                     runner=runner, draft_runner=draft_runner)


def greedy_request(r: BenchRequest) -> GenerationRequest:
    """`r` as the engine takes it: greedy, exactly `r.num_output_tokens` tokens."""
    sampling = SamplingParams(max_tokens=r.num_output_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(r.request_id, list(r.prompt_token_ids), sampling)


def warm_engine(model: LoadedModel, config: EngineConfig, runner: ModelRunner,
                workload: Workload) -> float:
    """Compile every bucket and push one short request through; returns the seconds taken."""
    start = time.perf_counter()
    runner.warmup()
    engine = new_engine(model, config, runner)
    first = workload.requests[-1]
    engine.add(greedy_request(BenchRequest("warmup", first.prompt_token_ids[:8], 2)))
    for _ in engine.run_until_done():
        pass
    return time.perf_counter() - start


def run_engine(model: LoadedModel, config: EngineConfig, runner: ModelRunner,
               workload: Workload, warmup_s: float = 0.0) -> SystemResult:
    engine = new_engine(model, config, runner)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in workload.requests}
    outcomes: dict[str, RequestOutcome] = {}
    meter = KVWasteMeter()
    bs = config.scheduler.block_size
    with CompileCounter() as compiles:
        clock = Clock()
        for r in workload.requests:
            engine.add(greedy_request(r))
        while engine.has_work():
            events = engine.step()
            now = clock()
            usage = engine.scheduler.kv_cache.usage()
            reserved = usage.num_used_blocks * bs
            meter.sample(now, reserved, min(reserved, round(usage.waste * reserved)))
            for ev in events:
                tokens[ev.request_id].extend(ev.token_ids)
                if ev.finished:
                    if ev.finish_reason != "length":
                        raise RuntimeError(f"engine: request {ev.request_id} ended with "
                                           f"{ev.finish_reason!r} ({ev.error})")
                    outcomes[ev.request_id] = RequestOutcome(
                        ev.request_id, tuple(tokens[ev.request_id]), now)
        wall = clock()
        meter.finish(wall)
    engine.scheduler.check_integrity()
    stats = engine.scheduler.stats()
    return SystemResult("engine", wall, outcomes, meter.waste, meter.peak_allocated,
                        compiles.count, warmup_s,
                        {"steps": engine.num_steps, "preemptions": stats.num_preemptions,
                         "prefix_hit_tokens": stats.prefix_cache.hit_tokens,
                         "host_ms_per_step": engine.host_time.per_step_ms()})
