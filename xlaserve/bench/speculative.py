"""`xlaserve bench spec`: one workload through the engine without and with speculation (n-gram
lookup, or a draft model: `--method draft`), on one runner (and one draft runner), the two
interleaved (off, on, then on, off, ...) so the machine's drift hits both alike.

    --mode single   each request alone (single stream); TPOT per request = (time of its last
                    event - time of its first) / (tokens - 1)
    --mode batch    every request at once; throughput = output tokens / wall seconds
    -> per system the median, the ratio off / on of the medians (and per round), the mean
       acceptance length, and whether the outputs are identical (greedy: they must be)
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import jax

from xlaserve.bench.engine_system import greedy_request, new_engine, warm_engine
from xlaserve.bench.report import write_json
from xlaserve.bench.workload import BenchRequest, get_workload
from xlaserve.serving.engine import EngineConfig
from xlaserve.serving.engine.draft_model import make_draft_runner
from xlaserve.serving.engine.factory import make_runner
from xlaserve.serving.loading import LoadedModel, load_model
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.runner.draft_runner import DraftRunner
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.speculative import SpecStats, SpeculativeConfig

MODES = ("single", "batch")


@dataclass
class Run:
    """One pass of the workload through one engine."""

    seconds: float                          # wall
    tokens: dict[str, tuple[int, ...]]      # per request
    tpot: list[float]                       # single mode: one per request with >= 2 tokens
    steps: int
    spec: SpecStats
    compiles: int


def _drive(model: LoadedModel, config: EngineConfig, runner: ModelRunner,
           batches: list[list[BenchRequest]], draft_runner: DraftRunner | None = None) -> Run:
    """Each batch of requests added at once and run to the end, one batch after the other,
    through a fresh engine (no prefix cache carried over)."""
    engine = new_engine(model, config, runner, draft_runner)
    tokens: dict[str, list[int]] = {}
    tpot: list[float] = []
    with CompileCounter() as compiles:
        start = time.perf_counter()
        for batch in batches:
            first: dict[str, float] = {}
            for r in batch:
                engine.add(greedy_request(r))
            while engine.has_work():
                events = engine.step()
                now = time.perf_counter()
                for ev in events:
                    out = tokens.setdefault(ev.request_id, [])
                    out.extend(ev.token_ids)
                    first.setdefault(ev.request_id, now)
                    if ev.finished and len(out) > 1:
                        tpot.append((now - first[ev.request_id]) / (len(out) - 1))
        seconds = time.perf_counter() - start
    engine.scheduler.check_integrity()
    return Run(seconds, {k: tuple(v) for k, v in tokens.items()}, tpot, engine.num_steps,
               engine.scheduler.spec_stats.snapshot(), compiles.count)


def run_spec_bench(model: LoadedModel, workload: str, mode: str, rounds: int,
                   speculative: SpeculativeConfig, num_requests: int | None = None,
                   seed: int = 0) -> dict[str, Any]:
    if mode not in MODES:
        raise ValueError(f"--mode {mode!r}: choose from {MODES}")
    if rounds < 1:
        raise ValueError(f"--rounds {rounds} must be >= 1")
    spec = get_workload(workload)
    work = spec.build(model.tokenizer, seed, num_requests)
    off = spec.engine_config()
    on = off.with_args(speculative=speculative)
    runner = make_runner(model, off)
    warmup_s = warm_engine(model, off, runner, work)
    draft_runner = None
    if speculative.method == "draft":
        draft_runner = make_draft_runner(model.params, model.config, model.mesh, on)
        warmup_s += draft_runner.warmup()
    batches = [[r] for r in work.requests] if mode == "single" else [list(work.requests)]
    runs: dict[str, list[Run]] = {"off": [], "on": []}
    for i in range(rounds):
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            runs[name].append(_drive(model, on if name == "on" else off, runner, batches,
                                     draft_runner if name == "on" else None))
    tokens = work.num_output_tokens

    def summary(name: str) -> dict[str, Any]:
        rs = runs[name]
        out: dict[str, Any] = {
            "seconds": [r.seconds for r in rs], "steps": [r.steps for r in rs],
            "tokens_per_s": [tokens / r.seconds for r in rs],
            "median_tokens_per_s": statistics.median(tokens / r.seconds for r in rs),
            "compiles_after_warmup": sum(r.compiles for r in rs)}
        if mode == "single":
            out["median_tpot_ms"] = 1e3 * statistics.median(t for r in rs for t in r.tpot)
            out["round_median_tpot_ms"] = [1e3 * statistics.median(r.tpot) for r in rs]
        return out

    result: dict[str, Any] = {
        "workload": work.describe(), "mode": mode, "rounds": rounds,
        "speculative": asdict(speculative), "warmup_s": warmup_s,
        "machine": {"platform": platform.platform(), "jax": jax.__version__,
                    "devices": [str(d) for d in jax.devices()]},
        "off": summary("off"), "on": summary("on"),
        "identical_outputs": all(a.tokens == b.tokens for a, b in zip(runs["off"], runs["on"])),
    }
    s = runs["on"][-1].spec
    result["on"].update(mean_acceptance_length=s.mean_acceptance_length,
                        acceptance_rate=s.acceptance_rate, num_drafts=s.num_drafts)
    if mode == "single":
        result["tpot_ratio_off_over_on"] = (result["off"]["median_tpot_ms"]
                                            / result["on"]["median_tpot_ms"])
        result["round_tpot_ratios"] = [a / b for a, b in zip(
            result["off"]["round_median_tpot_ms"], result["on"]["round_median_tpot_ms"])]
    result["throughput_ratio_on_over_off"] = (result["on"]["median_tokens_per_s"]
                                              / result["off"]["median_tokens_per_s"])
    return result


def format_spec_report(r: dict[str, Any]) -> str:
    w = r["workload"]
    lines = [f"workload {w['name']}: {w['num_requests']} requests, {w['prompt_tokens']} prompt "
             f"/ {w['output_tokens']} output tokens; mode {r['mode']}, {r['rounds']} rounds "
             f"each, interleaved; speculative {r['speculative']}"]
    for name in ("off", "on"):
        s = r[name]
        tpot = f"  median TPOT {s['median_tpot_ms']:.2f} ms" if "median_tpot_ms" in s else ""
        lines.append(f"  spec {name:3}: median {s['median_tokens_per_s']:.1f} tok/s{tpot}  "
                     f"steps {s['steps']}  compiles after warm-up {s['compiles_after_warmup']}")
    on = r["on"]
    lines.append(f"  mean acceptance length {on['mean_acceptance_length']:.2f} tokens per verify "
                 f"row ({on['num_drafts']} rows, {100 * on['acceptance_rate']:.0f}% of drafts "
                 f"accepted); outputs identical: {r['identical_outputs']}")
    if "tpot_ratio_off_over_on" in r:
        rounds = ", ".join(f"{x:.2f}" for x in r["round_tpot_ratios"])
        lines.append(f"  TPOT off / on: {r['tpot_ratio_off_over_on']:.2f}x (per round: "
                     f"{rounds})")
    lines.append(f"  throughput on / off: {r['throughput_ratio_on_over_off']:.3f}")
    return "\n".join(lines)


def spec_main(model_dir: str, workload: str, mode: str, rounds: int,
              speculative: SpeculativeConfig, num_requests: int | None,
              json_out: str | None) -> int:
    result = run_spec_bench(load_model(model_dir), workload, mode, rounds, speculative,
                            num_requests)
    print(format_spec_report(result))
    if json_out:
        write_json(json_out, result, indent=2)
    return 0
