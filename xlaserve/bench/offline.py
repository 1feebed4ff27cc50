"""`xlaserve bench offline`: one workload through several systems in one process, one table.

    model folder --load--> LoadedModel ──> ModelRunner (buckets of the workload's EngineConfig)
    workload spec --build(tokenizer, seed)--> requests
    warm-up: every bucket compiled (untimed)
    engine  : LLMEngine on the runner                          engine_system.py
    static  : static batches of B on the same runner           static_system.py
    hf      : transformers generate, batches of B, torch CPU   hf_system.py
    then    : decode step at batch 1 vs bandwidth floor        roofline.py
              --breakdown: engine and static once more, every device call waited for and
              timed per bucket (runner/call_profile.py; not the headline numbers)
              per-device parameter and KV bytes of the engine's layout
    -> table on stdout, everything (per-request tokens included) as JSON
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax

from xlaserve.bench.engine_system import run_engine, warm_engine
from xlaserve.bench.metrics import SystemResult
from xlaserve.bench.report import format_table, write_json
from xlaserve.bench.roofline import measure_roofline, param_bytes
from xlaserve.bench.static_system import StaticBatcher
from xlaserve.bench.workload import Workload, get_workload
from xlaserve.serving.engine import EngineConfig
from xlaserve.serving.engine.factory import make_runner
from xlaserve.serving.loading import LoadedModel, load_model
from xlaserve.serving.runner.call_profile import CallProfile, format_rows
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.memory import device_bytes

SYSTEMS = ("engine", "static", "hf")


@dataclass(frozen=True)
class OfflineOptions:
    workload: str = "mixed"
    systems: tuple[str, ...] = SYSTEMS
    batch: int = 8
    seed: int = 0
    num_requests: int | None = None
    gguf: str | None = None          # for hf
    hf_dir: str | None = None        # for hf, instead of gguf
    decode_steps: int = 20
    copy_bytes: int = 512 << 20      # bandwidth probe array size
    breakdown: bool = False          # rerun engine/static with per-bucket call timing
    quantization: str | None = None  # "int8": int8 weights (quantized as the model loads)
    kv_cache_dtype: str | None = None   # "int8" | "fp8": a quantized KV cache

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"--systems {','.join(self.systems)}: choose from "
                             f"{','.join(SYSTEMS)}")
        if "hf" in self.systems and (self.gguf is None) == (self.hf_dir is None):
            raise ValueError("--systems hf needs exactly one of --gguf FILE or --hf-dir DIR")
        if self.batch < 1:
            raise ValueError(f"--batch {self.batch} must be >= 1")
        get_workload(self.workload)


def _agreement(results: list[SystemResult]) -> dict[str, int]:
    """Requests whose tokens equal the first system's, per other system."""
    if len(results) < 2:
        return {}
    ref = results[0]
    return {f"{r.system} == {ref.system}": sum(
        r.outcomes[rid].token_ids == o.token_ids for rid, o in ref.outcomes.items())
        for r in results[1:]}


def run_offline(model: LoadedModel, options: OfflineOptions,
                engine_config: EngineConfig | None = None) -> dict[str, Any]:
    spec = get_workload(options.workload)
    workload = spec.build(model.tokenizer, options.seed, options.num_requests)
    config = engine_config or spec.engine_config(options.batch)
    if options.kv_cache_dtype:
        config = config.with_args(kv_cache_dtype=options.kv_cache_dtype)
    runner = make_runner(model, config)
    results: list[SystemResult] = []
    warmup_s = 0.0
    if "engine" in options.systems or "static" in options.systems:
        warmup_s = warm_engine(model, config, runner, workload)
    if "engine" in options.systems:
        results.append(run_engine(model, config, runner, workload, warmup_s))
    if "static" in options.systems:
        static = StaticBatcher(runner, options.batch, config.scheduler.max_prefill_chunk)
        results.append(static.run(workload, warmup_s))
    if "hf" in options.systems:
        from xlaserve.bench.hf_system import load_hf_model, run_hf

        hf = load_hf_model(options.gguf, options.hf_dir)
        eos = model.config.eos_token_ids   # hf pads its batches with the first EOS id
        results.append(run_hf(hf, workload, options.batch, pad_id=int(eos[0]) if eos else 0))
    for r in results:
        r.check(workload)
    roofline = None
    if "engine" in options.systems or "static" in options.systems:
        roofline = measure_roofline(runner, workload.requests[0].prompt_token_ids,
                                    options.decode_steps, options.copy_bytes)
    breakdown = {}
    if options.breakdown:
        breakdown = _breakdown(model, config, runner, workload, options)
    memory = device_bytes(ShardLayout.create(model.config, model.mesh),
                          config.scheduler.num_kv_blocks, config.scheduler.block_size,
                          config.kv_dtype)
    if runner.packed:   # one device holding the CPU kernels' panels (and a tied head's copy)
        resident = param_bytes(runner.params)
        memory = replace(memory, params=resident, params_total=resident)
    return {
        "workload": workload.describe(),
        "model": {"layers": model.config.num_layers, "hidden": model.config.hidden_size,
                  "params": model.config.num_params, "dtype": model.config.dtype},
        "engine_config": asdict(config),
        "batch": options.batch,
        "machine": {"platform": platform.platform(), "jax": jax.__version__,
                    "devices": [str(d) for d in jax.devices()]},
        "systems": [r.summary() for r in results],
        "agreement": _agreement(results),
        "decode_batch1": roofline.to_dict() if roofline else None,
        "breakdown": {name: {"seconds": p.seconds, "phases": p.phase_seconds(),
                             "buckets": p.rows()} for name, p in breakdown.items()},
        "memory": {**asdict(memory), "describe": memory.describe()},
        "requests": {r.system: r.per_request() for r in results},
    }


def _breakdown(model: LoadedModel, config: EngineConfig, runner: ModelRunner,
               workload: Workload, options: OfflineOptions) -> dict[str, CallProfile]:
    """Engine and static once more with every call timed by bucket (slower than the timed
    runs: each call is waited for)."""
    out: dict[str, CallProfile] = {}
    for system in ("engine", "static"):
        if system not in options.systems:
            continue
        runner.profile = profile = CallProfile()
        try:
            if system == "engine":
                run_engine(model, config, runner, workload)
            else:
                StaticBatcher(runner, options.batch,
                              config.scheduler.max_prefill_chunk).run(workload)
        finally:
            runner.profile = None
        out[system] = profile
    return out


def describe(report: dict[str, Any]) -> str:
    w = report["workload"]
    title = (f"workload {w['name']} (seed {w['seed']}): {w['num_requests']} requests, prompts "
             f"{w['prompt_min']}-{w['prompt_max']} tokens ({w['prompt_tokens']} in all), "
             f"outputs {w['output_min']}-{w['output_max']} ({w['output_tokens']} in all); "
             f"model {report['model']['layers']} layers, {report['model']['dtype']}")
    lines = [title, "", format_table(report["systems"]), ""]
    for pair, n in report["agreement"].items():
        lines.append(f"greedy tokens {pair}: {n}/{w['num_requests']} requests identical")
    if report["decode_batch1"]:
        from xlaserve.bench.roofline import Roofline

        d = {k: v for k, v in report["decode_batch1"].items() if k != "ratio"}
        lines.append(Roofline(**d).describe())
    for s in report["systems"]:
        if "host_ms_per_step" in s:
            host = ", ".join(f"{k} {v:.2f}" for k, v in s["host_ms_per_step"].items())
            lines.append(f"{s['system']} host time per step (ms; wait = blocked on the "
                         f"device): {host} over {s['steps']} steps")
    lines.append(f"engine layout {report['memory']['describe']}")
    for system, b in report.get("breakdown", {}).items():
        lines += ["", f"breakdown of {system} (every call waited for):",
                  format_rows(b["buckets"])]
    return "\n".join(lines)


def offline_main(model_dir: str, options: OfflineOptions, json_out: str | None) -> int:
    model = load_model(model_dir, quantization=options.quantization)
    report = run_offline(model, options)
    print(describe(report), flush=True)
    if json_out:
        write_json(json_out, report)
    return 0
