"""gpu_check step 5: fp8 weights (kernels/quantized.py) and fp8 KV rows (kernels/kv_quant.py)
against float references, and the weight matmul's time by weight format."""

from __future__ import annotations

from typing import Any

import numpy as np

from xlaserve.kernels.bench.attention_checks import make_inputs, rel_error
from xlaserve.kernels.bench.timing import Clock, bench, record


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
