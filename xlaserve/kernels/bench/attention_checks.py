"""gpu_check steps 2 and 3: every attention kernel against the pure-jnp reference on random
inputs (`check_correctness`), and each kernel's median time and achieved bytes/s
(`time_kernels`).  `AttnShape` names a batch's shape; `decode_ops` / `prefill_ops` are the
implementations under test, JAX's own pallas.ops.gpu.paged_attention among them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.kernels.bench.timing import Clock, bench, record


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
