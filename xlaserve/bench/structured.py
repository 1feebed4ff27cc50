"""What structured outputs cost the engine: the `mixed` workload run with no constraints and
with every other request under a JSON schema, alternately in one process, on one warmed-up
runner; output tokens/s per run (medians) and compiles during the constrained runs.

    python -m xlaserve.bench.structured --model MODEL_DIR [--requests 32] [--repeat 3]
    python -m xlaserve.bench.structured --sampler [--repeat 50]

`--sampler` times the compiled sampler alone on [32, 49152] random logits, interleaved: without
a mask argument (the sampler before structured outputs), with an all-set mask (what every step
without constrained rows now pays) and with half the rows constrained.

Both runs do the same work: every request generates exactly its workload length (EOS ignored),
and the schema (an array of at least MIN_ITEMS integers) cannot be complete before that, so a
constrained request never ends early; its every token is masked by the grammar.
"""

from __future__ import annotations

import argparse
import statistics
import time

from xlaserve.bench.engine_system import new_engine
from xlaserve.bench.workload import WORKLOADS, Workload
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.loading import LoadedModel, load_model
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.structured.constraint import Constraint
from xlaserve.serving.types import GenerationRequest, SamplingParams

MIN_ITEMS = 1000
SCHEMA = {"type": "array", "minItems": MIN_ITEMS,
          "items": {"type": "integer", "minimum": 0, "maximum": 9999}}


def run(model: LoadedModel, engine: LLMEngine, workload: Workload, constrained: bool
        ) -> tuple[float, int, int, str]:
    """(seconds, output tokens, compiles, host time per step) of one pass over the
    workload."""
    fresh = new_engine(model, engine.config, engine.runner)
    c = Constraint.json_schema(SCHEMA)
    for i, r in enumerate(workload.requests):
        s = SamplingParams(max_tokens=r.num_output_tokens, temperature=0.0, ignore_eos=True,
                           constraint=c if constrained and i % 2 else None)
        fresh.add(GenerationRequest(r.request_id, list(r.prompt_token_ids), s))
    tokens = 0
    with CompileCounter() as compiles:
        start = time.perf_counter()
        for ev in fresh.run_until_done():
            tokens += len(ev.token_ids)
            if ev.finished and ev.finish_reason != "length":
                raise RuntimeError(f"{ev.request_id} ended with {ev.finish_reason}")
        took = time.perf_counter() - start
    assert tokens == workload.num_output_tokens, (tokens, workload.num_output_tokens)
    host = ", ".join(f"{k} {v:.2f}" for k, v in fresh.host_time.per_step_ms().items())
    return took, tokens, compiles.count, f"{fresh.num_steps} steps; ms per step: {host}"


def sampler_costs(repeat: int, rows: int = 32, vocab: int = 49152) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from xlaserve.serving.runner.sampling import SamplingArrays, sample
    from xlaserve.serving.runner.token_mask import all_allowed

    logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab), np.float32))
    half = all_allowed(rows, vocab)
    half[::2] = 0
    half[::2, :4] = -1                       # the even rows may take 128 tokens
    plain = jax.jit(lambda z, s: sample(z, s))
    masked = jax.jit(lambda z, s, m: sample(z, s, m))
    free, half_j = jnp.asarray(all_allowed(rows, vocab)), jnp.asarray(half)
    for temperature in (0.0, 1.0):
        s = SamplingArrays(jnp.full(rows, temperature, jnp.float32), jnp.zeros(rows, jnp.int32),
                           jnp.ones(rows, jnp.float32), jnp.zeros(rows, jnp.float32),
                           jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32),
                           jnp.zeros((rows, vocab), jnp.float32), jnp.zeros(rows, jnp.bool_))
        cases = {"no mask argument": lambda: plain(logits, s),
                 "all-set mask": lambda: masked(logits, s, free),
                 "half the rows constrained": lambda: masked(logits, s, half_j)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for f in cases.values():
            jax.block_until_ready(f())
        for _ in range(repeat):
            for k, f in cases.items():
                start = time.perf_counter()
                jax.block_until_ready(f())
                times[k].append(time.perf_counter() - start)
        base = statistics.median(times["no mask argument"])
        for k, v in times.items():
            m = statistics.median(v)
            print(f"temperature {temperature:g}, {rows} rows: {k:26s} median {1e3 * m:6.2f} ms"
                  f"  ratio {m / base:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--sampler", action="store_true")
    args = p.parse_args(argv)
    if args.sampler:
        sampler_costs(args.repeat)
        return 0
    if not args.model:
        p.error("--model is required (unless --sampler)")
    model = load_model(args.model)
    spec = WORKLOADS["mixed"]
    workload = spec.build(model.tokenizer, 0, args.requests)
    engine = LLMEngine(model.params, model.config, model.tokenizer, model.mesh,
                       spec.engine_config())
    engine.runner.warmup()
    run(model, engine, spec.build(model.tokenizer, 1, 4), True)   # first-call host work
    ratios = []
    results: dict[bool, list[float]] = {False: [], True: []}
    compiles = 0
    for _ in range(args.repeat):
        for constrained in (False, True):
            took, tokens, n, host = run(model, engine, workload, constrained)
            results[constrained].append(tokens / took)
            compiles += n if constrained else 0
            if constrained:
                ratios.append(results[True][-1] / results[False][-1])
            print(f"{'half under a schema' if constrained else 'unconstrained':20s} "
                  f"{tokens} tokens in {took:.2f} s: {tokens / took:.1f} tokens/s ({host})",
                  flush=True)
    free, half = statistics.median(results[False]), statistics.median(results[True])
    print(f"workload: mixed, {args.requests} requests, {workload.num_output_tokens} output "
          f"tokens; medians of {args.repeat}: unconstrained {free:.1f} tokens/s, half under a "
          f"schema {half:.1f} tokens/s, ratio {half / free:.3f} (median of the pairs' ratios "
          f"{statistics.median(ratios):.3f}); compiles in the constrained runs: {compiles}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
