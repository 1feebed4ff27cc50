"""`xlaserve bench step`: every kind of device step timed next to its floor, in one process.

    probes   read bandwidth: threaded numpy passes that only read a 512 MiB array (sum, dot),
             the best of them; copy bandwidth (read + write, reported, not the floor's: a
             decode step reads); GEMM rate: XLA's f32 dot of [1024, 1024] x [1024, 1024], and
             the native kernel on the same shape when it is built (the higher is the rate)
    steps    runner.run of real rows on the engine's runner (its backend, its buckets), each
             waited for; median of `repeats` calls (`ms`, the host's work included); and,
             decode only, `pipelined ms`: the mean step of a run of calls each launched before
             the previous one's tokens are fetched, as the engine runs them (the host's work
             overlaps the device's but shares its cores):
               decode   R rows of one token over a `context`-token history, table width W
               prefill  one row of C prompt tokens (fresh: nothing cached)
    floor    max(bytes read / read bandwidth, FLOPs / GEMM rate) of that step, with the rates
             its own probes measured just before and just after it was timed (the higher of
             each): a shared box's bandwidth can swing between ~40 and ~70 GB/s from one minute
             to the next (BENCHMARKS.md, ninth session), so a floor from probes taken minutes
             earlier may describe another machine; the report's first line has the probes of
             the run's start:
               bytes    the weights a step reads (all of them; an untied input embedding one
                        row per token) + the K/V it attends to + the K/V it writes
               FLOPs    2 x matmul weights x tokens + 2 x logits rows x V x E + attention
                        (4 x H x D per query-key pair)
    breakdown (--breakdown) the same step's parts alone at its shapes: the 30-layer weight
             matmuls, the attention of every layer, the output head, the sampler, and the host
             time to lay the rows out (HostStep)
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.bench.report import write_json
from xlaserve.bench.roofline import (
    decode_read_bytes,
    median_seconds,
    thread_bounds,
    threaded_copy_bandwidth,
)
from xlaserve.models.config import ModelConfig
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN, ScheduledSeq

# -- probes ---------------------------------------------------------------------------------------


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> dict[str, float]:
    """Bytes read per second by passes that only read, one thread per core (GB/s per probe)."""
    a = np.ones(nbytes // 4, np.float32)
    bounds = thread_bounds(a.size)
    probes = {"sum": lambda s, e: a[s:e].sum(), "dot": lambda s, e: np.dot(a[s:e], a[s:e])}
    out = {}
    with ThreadPoolExecutor(len(bounds)) as pool:
        for name, f in probes.items():
            sec = median_seconds(lambda: list(pool.map(lambda b: f(*b), bounds)), repeats)
            out[f"read_{name}"] = a.nbytes / sec / 1e9
    return out


def gemm_rate(n: int = 1024, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of an f32 [n, n] x [n, n] matmul: XLA's dot, and the native kernel if built."""
    from xlaserve.kernels.matmul import layer_matmul, uses_kernel

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    flops = 2.0 * n ** 3
    out = {}
    xla = jax.jit(lambda x, w: x @ w)
    out["xla_dot"] = flops / median_seconds(lambda: xla(x, w).block_until_ready(), repeats) / 1e9
    if uses_kernel(x, True):
        native = jax.jit(lambda x, w: layer_matmul(x, (w,), jnp.int32(0))[0])
        out["native"] = flops / median_seconds(lambda: native(x, w).block_until_ready(),
                                        repeats) / 1e9
    return out


# -- what a step costs at least -------------------------------------------------------------------


def matmul_weights(config: ModelConfig) -> int:
    """Weights every token multiplies in the layers (not the embedding / head)."""
    c = config
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim \
        + c.num_heads * c.head_dim * c.hidden_size
    return c.num_layers * (attn + 3 * c.hidden_size * c.intermediate_size)


def step_cost(config: ModelConfig, params: Any, rows: int, tokens: int,
              keys_per_query: float, kv_read_tokens: int,
              kv_row_bytes: int | None = None) -> tuple[int, float]:
    """(bytes read, FLOPs) of a step: `tokens` query tokens over `rows` rows (each row's
    logits once), each query seeing `keys_per_query` keys on average; `kv_read_tokens`
    distinct cached tokens are read per layer.  `kv_row_bytes`: one token's K (or V) of one
    kv head in the cache (default float32: 4 x head_dim; an int8 cache's: head_dim + 4)."""
    c = config
    item = np.dtype(c.dtype).itemsize
    row = 4 * c.head_dim if kv_row_bytes is None else kv_row_bytes
    kv_token = 2 * c.num_kv_heads * c.num_layers * row   # K and V, every layer
    bytes_read = decode_read_bytes(params) + kv_read_tokens * kv_token + tokens * kv_token
    if "lm_head" in params:   # untied: the input embedding is read one row per token
        bytes_read += (tokens - 1) * c.hidden_size * item
    attention = 4.0 * c.num_heads * c.head_dim * keys_per_query * tokens * c.num_layers
    flops = 2.0 * matmul_weights(c) * tokens + 2.0 * rows * c.vocab_size * c.hidden_size \
        + attention
    return int(bytes_read), flops


@dataclass
class StepRow:
    kind: str                 # decode | prefill
    rows: int
    tokens: int
    context: int              # cached tokens per row before the step
    bucket: tuple[int, int, int]
    ms: float
    bytes_read: int
    flops: float
    floor_ms: float
    bound: str                # memory | compute: which term sets the floor
    pipelined_ms: float | None = None   # decode: per step, launched ahead as the engine does
    read_gb_s: float = 0.0    # the rates its floor uses (its probes, before and after it)
    gemm_gflops: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.ms / self.floor_ms

    @property
    def pipelined_ratio(self) -> float | None:
        return None if self.pipelined_ms is None else self.pipelined_ms / self.floor_ms

    @property
    def gflops(self) -> float:
        return self.flops / self.ms / 1e6


@dataclass
class StepReport:
    backend: str
    read_gb_s: float
    copy_gb_s: float
    gemm_gflops: float
    probes: dict[str, float]
    rows: list[StepRow]


# -- the measurements -----------------------------------------------------------------------------


def _table(runner: ModelRunner, row: int, blocks: int) -> list[int]:
    first = 1 + row * blocks
    if first + blocks > runner.num_blocks:
        raise ValueError(f"the step needs {blocks} blocks per row for row {row}: the runner "
                         f"has {runner.num_blocks}")
    return list(range(first, first + blocks))


def decode_rows(runner: ModelRunner, rows: int, context: int, width: int
                ) -> list[ScheduledSeq]:
    """`rows` decode rows (owners `decode-{r}`) after `context` cached tokens, tables `width`
    blocks wide (the KV values are whatever the cache holds: timing does not depend on
    them)."""
    if context + 1 > width * runner.block_size:
        raise ValueError(f"context {context} does not fit a table of {width} blocks")
    return [runner.row(f"decode-{r}", (PENDING_TOKEN,), context, _table(runner, r, width))
            for r in range(rows)]


def prefill_rows(runner: ModelRunner, tokens: int) -> list[ScheduledSeq]:
    """One fresh row (owner `prefill`) of `tokens` prompt tokens (nothing cached)."""
    return [runner.row("prefill", tuple(range(1, tokens + 1)), 0,
                       _table(runner, 0, -(-tokens // runner.block_size)))]


def time_rows(runner: ModelRunner, rows: list[ScheduledSeq], repeats: int) -> float:
    return median_seconds(lambda: runner.run(rows).out.tokens.block_until_ready(), repeats) * 1e3


def time_pipelined(runner: ModelRunner, rows: list[ScheduledSeq], steps: int) -> float:
    """ms per step over `steps` calls, each launched before the previous one is fetched (the
    engine's pipelined loop: rows whose token is PENDING_TOKEN read it from the device)."""
    runner.run(rows).fetch()
    start = time.perf_counter()
    last = runner.run(rows)
    for _ in range(steps - 1):
        launched = runner.run(rows)
        last.fetch()
        last = launched
    last.fetch()
    return (time.perf_counter() - start) / steps * 1e3


def rates(probe_bytes: int) -> tuple[float, float]:
    """(read GB/s, GEMM GFLOP/s) now: the best of each probe."""
    return max(read_bandwidth(probe_bytes).values()), max(gemm_rate().values())


def measure_step(runner: ModelRunner, kind: str, rows: list[ScheduledSeq], context: int,
                 repeats: int, probe_bytes: int, breakdown: bool) -> StepRow:
    """One kind of step timed (the rows' token cells are given back after)."""
    try:
        return _measure_step(runner, kind, rows, context, repeats, probe_bytes, breakdown)
    finally:
        for r in rows:
            runner.cells.release(r.request_id)


def _measure_step(runner: ModelRunner, kind: str, rows: list[ScheduledSeq], context: int,
                  repeats: int, probe_bytes: int, breakdown: bool) -> StepRow:
    c = runner.config
    tokens = sum(r.num_tokens for r in rows)
    if kind == "decode":
        keys, distinct = context + 1, len(rows) * context
    else:
        keys, distinct = context + (tokens + 1) / 2, context
    kv_row = runner.kv.k.shape[-1] * runner.kv.k.dtype.itemsize
    bytes_read, flops = step_cost(c, runner.params, len(rows), tokens, keys, distinct, kv_row)
    before = rates(probe_bytes)
    ms = time_rows(runner, rows, repeats)
    pipelined = time_pipelined(runner, rows, max(20, 4 * repeats)) if kind == "decode" else None
    read, gemm = (max(a, b) for a, b in zip(before, rates(probe_bytes)))
    mem_ms, flop_ms = 1e3 * bytes_read / (read * 1e9), 1e3 * flops / (gemm * 1e9)
    row = StepRow(kind, len(rows), tokens, context, runner.host_step(rows).shape, ms,
                  bytes_read, flops, max(mem_ms, flop_ms),
                  "memory" if mem_ms >= flop_ms else "compute", pipelined, read_gb_s=read,
                  gemm_gflops=gemm)
    if breakdown:
        from xlaserve.bench.step_parts import part_times

        row.breakdown = part_times(runner, rows, repeats)
    return row


def run_steps(runner: ModelRunner, *, decode_batches: list[int], width: int, context: int,
              prefill_chunks: list[int], repeats: int = 10, breakdown: bool = False,
              probe_bytes: int = 512 << 20) -> StepReport:
    probes = read_bandwidth(probe_bytes)
    copy = threaded_copy_bandwidth(probe_bytes) / 1e9   # GB/s
    gemm = gemm_rate()
    read_bw, gemm_best = max(probes.values()), max(gemm.values())
    probes.update(copy=copy, **{f"gemm_{k}": v for k, v in gemm.items()})
    steps = [("decode", decode_rows(runner, b, context, width), context) for b in decode_batches]
    steps += [("prefill", prefill_rows(runner, n), 0) for n in prefill_chunks]
    runner.warmup(sorted({runner.bucket(rows) for _, rows, _ in steps}))
    out = []
    for kind, rows, cached in steps:
        out.append(measure_step(runner, kind, rows, cached, repeats, probe_bytes, breakdown))
        print(describe_row(out[-1]), flush=True)
    return StepReport(runner.backend, read_bw, copy, gemm_best, probes, out)


# -- reporting ------------------------------------------------------------------------------------


def describe_row(r: StepRow) -> str:
    what = f"decode {r.rows} rows x ctx {r.context}" if r.kind == "decode" else \
        f"prefill {r.tokens} tokens"
    parts = "; ".join(f"{k} {v:.1f}" for k, v in r.breakdown.items())
    piped = "" if r.pipelined_ms is None else \
        f" (pipelined {r.pipelined_ms:.1f} ms = {r.pipelined_ratio:4.2f}x)"
    return (f"{what:<28} bucket {r.bucket}: {r.ms:7.1f} ms, floor {r.floor_ms:6.1f} ms "
            f"({r.bound}) = {r.ratio:4.2f}x{piped}, {r.gflops:6.1f} GFLOP/s (probes "
            f"{r.read_gb_s:.1f} GB/s, {r.gemm_gflops:.0f} GFLOP/s)"
            + (f"  [{parts}]" if parts else ""))


def format_report(rep: StepReport) -> str:
    head = (f"backend {rep.backend}; read bandwidth {rep.read_gb_s:.1f} GB/s (copy probe "
            f"{rep.copy_gb_s:.1f} GB/s read+write), GEMM {rep.gemm_gflops:.1f} GFLOP/s; probes: "
            + ", ".join(f"{k} {v:.1f}" for k, v in rep.probes.items()))
    lines = [head, "", "| step | bucket (R, T, W) | ms | floor ms | bound | ratio | "
                       "pipelined ms | pipelined ratio | GFLOP/s | its probes GB/s, GFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep.rows:
        what = f"decode {r.rows} x ctx {r.context}" if r.kind == "decode" else \
            f"prefill {r.tokens}"
        piped = "- | -" if r.pipelined_ms is None else \
            f"{r.pipelined_ms:.1f} | {r.pipelined_ratio:.2f}x"
        lines.append(f"| {what} | {r.bucket} | {r.ms:.1f} | {r.floor_ms:.1f} | {r.bound} | "
                     f"{r.ratio:.2f}x | {piped} | {r.gflops:.1f} | {r.read_gb_s:.1f}, "
                     f"{r.gemm_gflops:.0f} |")
    if any(r.breakdown for r in rep.rows):
        names = list(next(r.breakdown for r in rep.rows if r.breakdown))
        lines += ["", "| step | " + " | ".join(f"{n} ms" for n in names) + " |",
                  "|---|" + "---|" * len(names)]
        for r in rep.rows:
            what = f"decode {r.rows}" if r.kind == "decode" else f"prefill {r.tokens}"
            lines.append(f"| {what} | " + " | ".join(f"{r.breakdown.get(n, 0):.1f}"
                                                     for n in names) + " |")
    return "\n".join(lines)


def step_main(model_dir: str, *, decode_batches: list[int], width: int, context: int,
              prefill_chunks: list[int], repeats: int, breakdown: bool, backend: str,
              json_out: str | None, quantization: str | None = None,
              kv_cache_dtype: str | None = None) -> int:
    from xlaserve.serving.engine.config import EngineConfig
    from xlaserve.serving.loading import load_model

    model = load_model(model_dir, quantization=quantization)
    most = max(decode_batches)
    blocks = max(width, -(-max(prefill_chunks, default=1) // 16))
    config = EngineConfig.from_args(max_model_len=max(2048, blocks * 16),
                                    num_kv_blocks=most * blocks + 2, max_num_seqs=most,
                                    max_num_batched_tokens=max(max(prefill_chunks, default=16),
                                                               most + 1),
                                    attention_backend=backend,
                                    kv_cache_dtype=kv_cache_dtype or "auto")
    runner = ModelRunner(model.params, model.config, model.mesh,
                         num_blocks=config.scheduler.num_kv_blocks,
                         block_size=config.scheduler.block_size,
                         max_num_seqs=config.scheduler.max_num_seqs, buckets=config.bucket_plan,
                         attention_backend=config.attention_backend, kv_dtype=config.kv_dtype)
    report = run_steps(runner, decode_batches=decode_batches, width=width, context=context,
                       prefill_chunks=prefill_chunks, repeats=repeats, breakdown=breakdown)
    print(format_report(report), flush=True)
    if json_out:
        data = asdict(report)
        for row, r in zip(data["rows"], report.rows):
            row.update(ratio=r.ratio, pipelined_ratio=r.pipelined_ratio, gflops=r.gflops)
        data["jax"] = jax.__version__
        write_json(json_out, data)
    return 0
