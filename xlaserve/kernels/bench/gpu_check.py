"""H200 check of the attention kernels: correctness, kernel timings, full-model decode tokens/s.

    python -m xlaserve.kernels.bench.gpu_check [--wheels DIR] [--json PATH] [--budget-s 450]
    python -m xlaserve.kernels.bench.gpu_check --cpu-smoke      # tiny shapes, interpret mode

Steps, in order, each bounded by one overall time budget (entries past it are reported as
skipped, so the run ends in time and still prints its table):

  1. setup        install jax-triton==0.3.1 from a local wheel folder when it is missing
                  (--wheels or $XLASERVE_WHEELS; no network), measure device copy bandwidth
  2. correctness  every kernel against the pure-jnp reference on random bf16 and f32 inputs
  3. kernels      median time (warm-up, block_until_ready, many repeats) of each decode kernel,
                  the jnp reference and JAX's own pallas.ops.gpu.paged_attention, and of the
                  prefill kernel against the reference; achieved bytes/s vs copy bandwidth
  4. model        models.llama.forward decode tokens/s with SmolLM2-135M shapes (random
                  weights) at batch 1, 32, 256, per attention backend; then bf16 weights
                  against int8 and fp8 (e4m3) weights, and an fp8 KV cache, on Pallas
  5. fp8          fp8 weights (kernels/quantized.py, the jnp path) and fp8 KV rows
                  (kernels/kv_quant.py) against float references: the matmul within e4m3's
                  error of the float32 one and equal to the dequantized weight's, decode
                  attention over fp8 rows equal to the reference over the dequantized
                  cache; and the weight matmul's time in bf16 / int8 / fp8 (bytes it reads)

The summary table is printed last; everything also goes to the JSON file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

JAX_TRITON_VERSION = "0.3.1"


# -- setup -------------------------------------------------------------------------------------

def ensure_jax_triton(wheels: str | None) -> str:
    """Import status of jax-triton after installing it from `wheels` if needed (no network)."""
    if importlib.util.find_spec("jax_triton") is not None:
        return "installed"
    if not wheels:
        return "missing (pass --wheels DIR or set XLASERVE_WHEELS to install it)"
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links",
           wheels, f"jax-triton=={JAX_TRITON_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()
    if proc.returncode != 0 or importlib.util.find_spec("jax_triton") is None:
        return f"install from {wheels} failed: {proc.stderr.strip()[-300:]}"
    return f"installed from {wheels}"


@dataclass
class Clock:
    """One deadline for the whole run."""

    deadline: float

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def record(rows: list[dict[str, Any]], tag: str, clock: Clock, row: dict[str, Any],
           fn: Callable[[], dict[str, Any]]) -> None:
    """Append `row` to `rows` with what `fn()` measured (and print it), with the error `fn`
    raised (a kernel that fails to build is a result, not a crash), or, past the time budget,
    marked skipped without running `fn`."""
    if clock.left() < 0:
        rows.append(dict(row, status="skipped: time budget"))
        return
    try:
        row.update(fn())
    except Exception as e:
        row["status"] = f"error: {type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    print(f"[{tag}] {row}", flush=True)


def bench(fn: Callable[[], Any], *, repeats: int) -> float:
    """Median seconds of `fn()`, after two warm-up calls (compile + first run)."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of a device elementwise op that reads and writes `nbytes` each."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / bench(lambda: add(x), repeats=repeats)


# -- inputs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttnShape:
    batch: int
    context: int      # kv length of every row
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    chunk: int = 1    # query tokens per row (1: decode)

    @property
    def name(self) -> str:
        kind = "decode" if self.chunk == 1 else f"prefill T={self.chunk}"
        return (f"{kind} B={self.batch} ctx={self.context} H={self.heads}/{self.kv_heads} "
                f"D={self.head_dim} bs={self.block_size}")

    def kv_bytes(self, itemsize: int) -> int:
        """K and V bytes attention must read: every row's cached tokens, once."""
        return 2 * self.batch * self.context * self.kv_heads * self.head_dim * itemsize


def make_inputs(s: AttnShape, dtype, seed: int = 0) -> dict[str, Any]:
    """Random cache (one layer) with shuffled block tables; every row is `context` long.
    Decode inputs also hold the per-layer [KVH, pages, page_size, D] copies JAX's kernel reads
    (k_t, v_t): made here, outside the timing."""
    import jax
    import jax.numpy as jnp

    w = -(-s.context // s.block_size)
    num_blocks = s.batch * w + 1
    key = jax.random.PRNGKey(seed)
    kk, kv, kq, kp = jax.random.split(key, 4)
    shape = (1, num_blocks, s.block_size, s.kv_heads, s.head_dim)
    k = jax.random.normal(kk, shape, jnp.float32).astype(dtype)
    v = jax.random.normal(kv, shape, jnp.float32).astype(dtype)
    q = jax.random.normal(kq, (s.batch, s.chunk, s.heads, s.head_dim), jnp.float32).astype(dtype)
    tables = (jax.random.permutation(kp, num_blocks - 1)[: s.batch * w] + 1).reshape(s.batch, w)
    x = dict(q=q, k=k, v=v, layer=jnp.int32(0), tables=tables.astype(jnp.int32),
             q_lens=jnp.full((s.batch,), s.chunk, jnp.int32),
             kv_lens=jnp.full((s.batch,), s.context, jnp.int32), scale=s.head_dim ** -0.5)
    if s.chunk == 1:
        x.update(k_t=jnp.transpose(k[0], (2, 0, 1, 3)), v_t=jnp.transpose(v[0], (2, 0, 1, 3)))
    return x


def rel_error(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


# -- the ops under test --------------------------------------------------------------------------

def decode_ops(interpret: bool, triton_ok: bool) -> dict[str, Callable[..., Any]]:
    """name -> f(inputs) -> [B, H, D] for every decode implementation available here."""
    import jax
    import jax.numpy as jnp

    from xlaserve.kernels import paged_attention as pa

    def args(x):
        return (x["q"][:, 0], x["k"], x["v"], x["layer"], x["tables"], x["kv_lens"])

    ref = jax.jit(pa.paged_attention_reference, static_argnames=("scale", "soft_cap"))
    ops: dict[str, Callable[..., Any]] = {
        "reference": lambda x: ref(*args(x), scale=x["scale"]),
        "pallas": lambda x: pa.paged_attention(*args(x), scale=x["scale"], interpret=interpret),
    }
    if triton_ok:
        from xlaserve.kernels.triton import paged_attention as tpa

        ops["triton"] = lambda x: tpa.paged_attention(*args(x), scale=x["scale"])

    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    def jax_kernel(x):
        # JAX's kernel reads [KVH, pages, page_size, D] (k_t, v_t: see `make_inputs`) and
        # applies no softmax scale: q is scaled first.
        k, v = x["k_t"], x["v_t"]
        w = x["tables"].shape[1]
        k_splits = math.gcd(w, 16)
        ppcb = math.gcd(w // k_splits, 8)
        q = (x["q"][:, 0].astype(jnp.float32) * x["scale"]).astype(x["q"].dtype)
        return jax_pa.paged_attention(q, k, v, x["tables"], x["kv_lens"], k_splits=k_splits,
                                      pages_per_compute_block=ppcb, interpret=interpret)

    ops["jax_pallas_gpu"] = jax_kernel
    return ops


def prefill_ops(interpret: bool) -> dict[str, Callable[..., Any]]:
    import jax

    from xlaserve.kernels import prefill_attention as pf

    def args(x):
        return (x["q"], x["k"], x["v"], x["layer"], x["tables"], x["q_lens"], x["kv_lens"])

    ref = jax.jit(pf.prefill_attention_reference, static_argnames=("scale", "soft_cap"))
    return {
        "reference": lambda x: ref(*args(x), scale=x["scale"]),
        "pallas": lambda x: pf.prefill_attention(*args(x), scale=x["scale"],
                                                 interpret=interpret),
    }


# -- steps ---------------------------------------------------------------------------------------

def check_correctness(shapes: list[AttnShape], interpret: bool, triton_ok: bool,
                      clock: Clock) -> list[dict[str, Any]]:
    import jax.numpy as jnp

    rows = []
    for s in shapes:
        for dtype in (jnp.float32, jnp.bfloat16):
            tol = 1e-5 if dtype == jnp.float32 else 1e-2
            x = make_inputs(s, dtype, seed=1)
            ops = decode_ops(interpret, triton_ok) if s.chunk == 1 else prefill_ops(interpret)
            expected = np.asarray(ops.pop("reference")(x), np.float32)
            if s.chunk == 1:
                expected = expected.reshape(s.batch, s.heads, s.head_dim)
            for name, op in ops.items():
                def check(op=op, x=x, expected=expected, tol=tol) -> dict[str, Any]:
                    err = rel_error(op(x), expected)
                    return dict(rel_error=err, status="ok" if err < tol else "FAIL")

                record(rows, "check", clock, dict(shape=s.name, dtype=jnp.dtype(dtype).name,
                                                  op=name, tolerance=tol), check)
    return rows


def time_kernels(shapes: list[AttnShape], interpret: bool, triton_ok: bool, bandwidth: float,
                 repeats: int, clock: Clock, reference_limit_bytes: int) -> list[dict[str, Any]]:
    import jax.numpy as jnp

    rows = []
    for s in shapes:
        if clock.left() < 0:
            rows.append(dict(shape=s.name, status="skipped: time budget"))
            continue
        x = make_inputs(s, jnp.bfloat16)
        ops = decode_ops(interpret, triton_ok) if s.chunk == 1 else prefill_ops(interpret)
        nbytes = s.kv_bytes(2)
        for name, op in ops.items():
            row = dict(shape=s.name, dtype="bfloat16", op=name, kv_bytes=nbytes)
            if name == "reference" and nbytes > reference_limit_bytes:
                # The reference gathers every row's K/V into a float32 copy first.
                rows.append(dict(row, status="skipped: gather reference too large"))
                continue

            def timed(op=op, x=x, nbytes=nbytes) -> dict[str, Any]:
                sec = bench(lambda: op(x), repeats=repeats)
                return dict(status="ok", ms=sec * 1e3, bytes_per_s=nbytes / sec,
                            frac_copy_bw=nbytes / sec / bandwidth)

            record(rows, "time", clock, row, timed)
    return rows


def model_decode(label: str, batches: list[int], context: int, backends: list[str], config,
                 repeats: int, clock: Clock, kv_dtype: str | None = None
                 ) -> list[dict[str, Any]]:
    """Decode tokens/s of models.llama.forward: one new token per row over `context` cached
    (weights as `config.quantization`, the cache in `kv_dtype`, None: the model's dtype)."""
    import functools

    import jax
    import jax.numpy as jnp

    from xlaserve.models.batch_metadata import decode_metadata
    from xlaserve.models.llama import AttentionMetadata, forward, init_kv_cache, init_params

    params = jax.tree_util.tree_map(jnp.asarray, init_params(config, seed=0))
    bs = 16
    rows = []
    for b in batches:
        for backend in backends:
            def timed(b: int = b, backend: str = backend) -> dict[str, Any]:
                w = -(-(context + 1) // bs)
                tables = (1 + np.arange(b * w, dtype=np.int32)).reshape(b, w)
                positions = np.full(b, context, np.int32)
                meta = AttentionMetadata(*(jnp.asarray(a) for a in
                                           decode_metadata(tables, positions, bs)))
                tokens, positions = jnp.zeros(b, jnp.int32), jnp.asarray(positions)
                step = jax.jit(functools.partial(forward, config=config,
                                                 attention_backend=backend),
                               donate_argnames=("kv",))
                state = {"kv": init_kv_cache(config, b * w + 1, bs, kv_dtype)}

                def run():
                    logits, state["kv"] = step(params, tokens=tokens, positions=positions,
                                               kv=state["kv"], meta=meta)
                    return logits

                sec = bench(run, repeats=repeats)
                return dict(status="ok", ms_per_step=sec * 1e3, tokens_per_s=b / sec)

            record(rows, "model", clock,
                   dict(model=label, batch=b, context=context, backend=backend,
                        variant=(f"{config.quantization or config.dtype} weights, "
                                 f"{kv_dtype or config.dtype} KV")), timed)
    return rows


def check_fp8(plan: dict[str, Any], interpret: bool, clock: Clock) -> list[dict[str, Any]]:
    """fp8 weights and KV rows against float references, and the weight matmul's time by
    weight format (see the module docstring, step 5)."""
    import jax
    import jax.numpy as jnp

    from xlaserve.kernels import paged_attention as pa
    from xlaserve.kernels.kv_quant import dequantize_rows, quantize_rows
    from xlaserve.kernels.matmul import layer_matmul
    from xlaserve.kernels.quantized import QuantizedWeight, dequantize, quantize_fp8, quantize_int8

    rows: list[dict[str, Any]] = []

    rng = np.random.default_rng(3)
    for m, k, n in plan["fp8_matmul"]:
        w = rng.standard_normal((1, k, n)).astype(np.float32)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        q = quantize_fp8(w, 1)
        qw = QuantizedWeight(jnp.asarray(q["q"]), jnp.asarray(q["scale"]))

        def matmul(x=x, w=w, q=q, qw=qw) -> dict[str, Any]:
            (got,) = jax.jit(lambda x: layer_matmul(x, (qw,), jnp.int32(0)))(x)
            hi = jax.lax.Precision.HIGHEST
            want = jnp.matmul(x, jnp.asarray(w[0]), precision=hi)
            exact = jnp.matmul(x, jnp.asarray(dequantize(q, 1)[0]), precision=hi)
            err, err_exact = rel_error(got, want), rel_error(got, exact)
            # e4m3 rounds each weight within 2^-4 of itself; summed over K the errors mostly
            # cancel: ~1-2% of the largest output.  Against the dequantized weight: the dot's
            # own precision (TF32-like on a GPU by default).
            ok = err < 6e-2 and err_exact < 5e-3
            return dict(rel_error=err, rel_error_dequantized=err_exact,
                        status="ok" if ok else "FAIL")

        record(rows, "fp8", clock,
               dict(check="fp8 weight matmul", shape=f"M={m} K={k} N={n}", tolerance=6e-2),
               matmul)

    for s in plan["check"][:1]:
        x = make_inputs(s, jnp.float32, seed=4)

        def kv(x=x) -> dict[str, Any]:
            k8, v8 = (quantize_rows(x[n], jnp.float8_e4m3fn) for n in ("k", "v"))
            args = (x["q"][:, 0], x["layer"], x["tables"], x["kv_lens"])
            dense = pa.paged_attention_reference(args[0], dequantize_rows(k8),
                                                 dequantize_rows(v8), *args[1:],
                                                 scale=x["scale"])
            float_cache = pa.paged_attention_reference(args[0], x["k"], x["v"], *args[1:],
                                                       scale=x["scale"])
            got = pa.paged_attention(args[0], k8, v8, *args[1:], scale=x["scale"],
                                     interpret=interpret)
            # the kernel must read fp8 rows exactly as they dequantize; how far that is from
            # the float cache is fp8's own rounding (informative: ~5-8% on N(0, 1) rows)
            err = rel_error(got, dense)
            return dict(rel_error=err, rel_error_float_cache=rel_error(dense, float_cache),
                        status="ok" if err < 1e-4 else "FAIL")

        record(rows, "fp8", clock,
               dict(check="fp8 KV pallas decode", shape=s.name, tolerance=1e-4), kv)

    m, k, n = plan["fp8_timed"]
    w = rng.standard_normal((1, k, n)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    formats = {"bfloat16": (jnp.asarray(w, jnp.bfloat16), 2 * k * n)}
    for name, quantize in (("int8", quantize_int8), ("fp8", quantize_fp8)):
        q = quantize(w, 1)
        formats[name] = (QuantizedWeight(jnp.asarray(q["q"]), jnp.asarray(q["scale"])),
                         k * n + 4 * k * n // 32)
    for name, (weight, nbytes) in formats.items():
        def timed(weight=weight, nbytes=nbytes) -> dict[str, Any]:
            f = jax.jit(lambda x: layer_matmul(x, (weight,), jnp.int32(0))[0])
            sec = bench(lambda: f(x), repeats=plan["repeats"])
            return dict(status="ok", ms=sec * 1e3, weight_bytes=nbytes,
                        bytes_per_s=nbytes / sec)

        record(rows, "fp8", clock,
               dict(check="weight matmul time", shape=f"M={m} K={k} N={n}", format=name), timed)
    return rows


# -- plans ---------------------------------------------------------------------------------------

def gpu_plan():
    from xlaserve.models.config import ModelConfig

    g8 = dict(heads=32, kv_heads=4, head_dim=128)   # GQA 8:1 (Llama-3-8B-like heads)
    g3 = dict(heads=9, kv_heads=3, head_dim=64)     # GQA 3:1 (SmolLM2)
    check = [AttnShape(3, 1000, block_size=16, **g8), AttnShape(4, 777, block_size=32, **g3),
             AttnShape(2, 600, block_size=16, chunk=200, **g3),
             AttnShape(2, 1100, block_size=32, chunk=64, **g8)]
    timed = [
        AttnShape(1, 1024, block_size=16, **g8), AttnShape(1, 32768, block_size=16, **g8),
        AttnShape(32, 8192, block_size=16, **g8), AttnShape(32, 8192, block_size=32, **g8),
        AttnShape(256, 1024, block_size=16, **g8), AttnShape(256, 4096, block_size=32, **g8),
        AttnShape(1, 32768, block_size=16, **g3), AttnShape(32, 8192, block_size=32, **g3),
        AttnShape(256, 2048, block_size=16, **g3), AttnShape(256, 32768, block_size=16, **g3),
        AttnShape(1, 4096, block_size=16, chunk=512, **g3),
        AttnShape(8, 2048, block_size=16, chunk=256, **g8),
    ]
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          tie_word_embeddings=True, dtype="bfloat16")
    return dict(check=check, timed=timed, model=smollm2, label="SmolLM2-135M shapes",
                batches=[1, 32, 256], context=1024,
                repeats=30, bandwidth_bytes=2 << 30, reference_limit=8 << 30,
                fp8_matmul=[(1, 576, 1536), (32, 4096, 4096), (256, 1536, 576)],
                fp8_timed=(1, 8192, 8192), quantized_batches=[1, 32], quantized_model=smollm2,
                quantized_variants=[("int8", None), ("fp8", None), ("fp8", "float8_e4m3fn")])


def smoke_plan():
    from xlaserve.models.config import ModelConfig

    g3 = dict(heads=6, kv_heads=2, head_dim=16)
    check = [AttnShape(2, 37, block_size=8, **g3),
             AttnShape(2, 21, block_size=8, chunk=5, **g3)]
    timed = [AttnShape(2, 64, block_size=16, **g3),
             AttnShape(1, 40, block_size=8, chunk=8, **g3)]
    tiny = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=6, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    return dict(check=check, timed=timed, model=tiny, label="tiny 2-layer",
                batches=[1, 2], context=20, repeats=10,
                bandwidth_bytes=1 << 20, reference_limit=1 << 40,
                fp8_matmul=[(3, 64, 40)], fp8_timed=(1, 64, 64), quantized_batches=[1],
                # head_dim 32: wo's groups of 32 run along each head's D
                quantized_model=tiny.replace(hidden_size=64, num_heads=2, num_kv_heads=1,
                                             head_dim=32),
                quantized_variants=[("fp8", "float8_e4m3fn")])   # the GPU plan: int8 and fp8 too


# -- report --------------------------------------------------------------------------------------

def table(report: dict[str, Any]) -> str:
    lines = [f"device: {report['device']}   copy bandwidth: "
             f"{report['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s   jax {report['jax']}   "
             f"jax-triton: {report['jax_triton']}"]
    checks = report["correctness"]
    bad = [r for r in checks if r["status"] != "ok"]
    lines.append(f"correctness: {len(checks) - len(bad)}/{len(checks)} ok"
                 + "".join(f"\n  {r['op']} {r['dtype']} {r['shape']}: {r['status']} "
                           f"(rel err {r.get('rel_error', float('nan')):.2e})" for r in bad))
    lines.append(f"{'kernel shape (bf16)':<58} {'op':<15} {'ms':>9} {'GB/s':>8} {'% copy':>7}")
    for r in report["kernels"]:
        if r["status"] == "ok":
            lines.append(f"{r['shape']:<58} {r['op']:<15} {r['ms']:>9.3f} "
                         f"{r['bytes_per_s'] / 1e9:>8.1f} {100 * r['frac_copy_bw']:>6.1f}%")
        else:
            lines.append(f"{r['shape']:<58} {r.get('op', ''):<15} {r['status']}")
    for r in report["fp8"]:
        what = f"{r['check']} {r.get('format', '')} {r['shape']}"
        if r["status"] != "ok":
            lines.append(f"{what}: {r['status']}")
        elif "ms" in r:
            lines.append(f"{what}: {r['ms']:.3f} ms, weights {r['bytes_per_s'] / 1e9:.1f} GB/s")
        else:
            lines.append(f"{what}: ok (rel err {r['rel_error']:.2e})")
    lines.append(f"{'model decode':<30} {'batch':>6} {'backend':<10} {'ms/step':>9} "
                 f"{'tok/s':>10}  weights, KV")
    for r in report["model"]:
        if r["status"] == "ok":
            lines.append(f"{r['model']:<30} {r['batch']:>6} {r['backend']:<10} "
                         f"{r['ms_per_step']:>9.3f} {r['tokens_per_s']:>10.1f}  {r['variant']}")
        else:
            lines.append(f"{r['model']:<30} {r['batch']:>6} {r['backend']:<10} {r['status']}"
                         f"  {r['variant']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes, kernels in interpret mode: proves the script runs")
    p.add_argument("--wheels", default=os.environ.get("XLASERVE_WHEELS"),
                   help="folder holding the jax-triton wheel (default $XLASERVE_WHEELS)")
    p.add_argument("--json", default="gpu_check.json", help="where to write the results")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="stop starting new measurements after this many seconds")
    args = p.parse_args(argv)
    start = time.perf_counter()
    clock = Clock(start + args.budget_s)

    jax_triton = "not used (--cpu-smoke)" if args.cpu_smoke else ensure_jax_triton(args.wheels)
    import jax

    on_gpu = jax.default_backend() == "gpu"
    if not args.cpu_smoke and not on_gpu:
        print(f"gpu_check needs a GPU; jax's backend is {jax.default_backend()!r} "
              f"(use --cpu-smoke on CPU)", file=sys.stderr)
        return 2
    interpret = not on_gpu
    if args.cpu_smoke:   # fp8 is a GPU option: the smoke run takes the test-only jnp path
        from xlaserve.kernels.quantized import FP8_ON_CPU_ENV

        os.environ[FP8_ON_CPU_ENV] = "1"
    triton_ok = on_gpu and importlib.util.find_spec("jax_triton") is not None
    plan = smoke_plan() if args.cpu_smoke else gpu_plan()

    bandwidth = copy_bandwidth(plan["bandwidth_bytes"], plan["repeats"])
    print(f"[setup] jax-triton: {jax_triton}; copy bandwidth {bandwidth / 1e9:.1f} GB/s",
          flush=True)
    report: dict[str, Any] = dict(
        device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
        jax=jax.__version__, python=platform.python_version(), jax_triton=jax_triton,
        interpret=interpret, copy_bandwidth_bytes_per_s=bandwidth,
        triton_skipped=None if triton_ok else "jax-triton needs a GPU" if not on_gpu
        else f"jax-triton unavailable: {jax_triton}")
    report["correctness"] = check_correctness(plan["check"], interpret, triton_ok, clock)
    report["kernels"] = time_kernels(plan["timed"], interpret, triton_ok, bandwidth,
                                     plan["repeats"], clock, plan["reference_limit"])
    backends = ["reference", "pallas"] + (["triton"] if triton_ok else [])
    report["model"] = model_decode(plan["label"], plan["batches"], plan["context"], backends,
                                   plan["model"],
                                   max(3, plan["repeats"] // 3), clock)
    # bf16 weights against int8 and fp8 ones, and an fp8 KV cache: Pallas decode
    for quantization, kv_dtype in plan["quantized_variants"]:
        report["model"] += model_decode(plan["label"], plan["quantized_batches"],
                                        plan["context"], ["pallas"],
                                        plan["quantized_model"].replace(
                                            quantization=quantization),
                                        max(3, plan["repeats"] // 3), clock, kv_dtype)
    report["fp8"] = check_fp8(plan, interpret, clock)
    report["wall_s"] = time.perf_counter() - start
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"[done] {report['wall_s']:.0f} s; results in {args.json}\n", flush=True)
    print(table(report))
    # JAX's own kernel is a baseline, not ours to pass: its rows inform, they do not fail.
    failed = any(r["status"] == "FAIL" or r["status"].startswith("error")
                 for r in [*(r for r in report["correctness"] if r["op"] != "jax_pallas_gpu"),
                           *report["fp8"]])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
