"""The parts of one device step, each timed alone at the step's shapes (`bench step --breakdown`).

    weights    the decoder's weight matmuls over every layer (a scan of q/k/v, o, gate/up,
               down), through the runner's backend
    attention  the paged attention of every layer over the step's real metadata and cache
    head       the final norm + output head for the step's rows
    sampler    the runner's compiled sampler for the step's rows (greedy rows)
    host       laying the rows out (runner.host_step) and copying the arrays to the device

They run back to back, not fused, so their sum exceeds the step a little (no overlap, each
reads its inputs from memory): what they show is where the time goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.bench.roofline import median_seconds
from xlaserve.kernels.attention import attention
from xlaserve.kernels.matmul import gated_matmul, layer_matmul
from xlaserve.models.llama import (
    AttentionMetadata,
    _as_matrix,
    attention_backend_uses_kernels,
    final_logits,
)
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.scheduler.step_plan import ScheduledSeq


def _ms(fn: Callable[[], Any], repeats: int) -> float:
    return 1e3 * median_seconds(lambda: jax.block_until_ready(fn()), repeats)


def part_times(runner: ModelRunner, rows: Sequence[ScheduledSeq], repeats: int
               ) -> dict[str, float]:
    c = runner.config
    params, backend = runner.params, runner.backend
    use_kernel = attention_backend_uses_kernels(backend)
    host = runner.host_step(rows)
    r, t, _ = host.shape
    layers = params["layers"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((t, c.hidden_size)) * 0.1,
                    jnp.float32)

    @jax.jit
    def weights(layers: Any, x: jax.Array) -> jax.Array:
        wq, wk, wv = (_as_matrix(layers[n], 2) for n in ("wq", "wk", "wv"))
        wo = _as_matrix(layers["wo"], 1)

        def body(x: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
            q, k, v = layer_matmul(x, (wq, wk, wv), i, use_kernel=use_kernel)
            (x,) = layer_matmul(q, (wo,), i, use_kernel=use_kernel, residual=x)
            g, u = layer_matmul(x, (layers["w_gate"], layers["w_up"]), i, use_kernel=use_kernel)
            x = gated_matmul(g, u, layers["w_down"], i, use_kernel=use_kernel, residual=x)
            return x + 0 * (k[:, :1] + v[:, :1]), None

        return jax.lax.scan(body, x, jnp.arange(c.num_layers, dtype=jnp.int32))[0]

    _, num_blocks, block_size, kvh, row = runner.kv.k.shape   # row: D, or D + 4 (int8, fp8)
    d = c.head_dim
    meta = AttentionMetadata(*(jnp.asarray(a) for a in (host.block_tables, host.token_rows,
                                                         host.slot_mapping)))
    positions = jnp.asarray(host.positions)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((t, c.num_heads, d)),
                    jnp.float32)

    @jax.jit
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        k_flat, v_flat = k.reshape(-1, kvh, row), v.reshape(-1, kvh, row)

        def body(acc: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
            out = attention(q + acc, k_flat, v_flat, i, meta.token_rows, positions,
                            meta.block_tables, num_blocks=num_blocks, block_size=block_size,
                            scale=d ** -0.5, sliding_window=c.sliding_window, backend=backend)
            return acc + 1e-3 * out, None

        return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(c.num_layers,
                                                                 dtype=jnp.int32))[0]

    @jax.jit
    def head(params: Any, x: jax.Array) -> jax.Array:
        return final_logits(params, c, x[:r], backend)

    logits = head(params, x)
    sampler = runner._compiled_sample[r]
    packed_rows, _, _ = runner._put(*host.packed())
    bias, allowed = runner._zeros_bias(r), runner._all_allowed(r)
    draft_q = runner._zeros_bias(r)   # the drafts' distributions: unread, no row has a draft

    def sample() -> Any:
        runner.token_cells, out = sampler(logits, runner.token_cells, packed_rows, bias,
                                          allowed, draft_q)
        return out.tokens

    def lay_out() -> None:
        h = runner.host_step(rows)
        jax.block_until_ready(runner._put(*h.packed()))

    return {
        "weights": _ms(lambda: weights(layers, x), repeats),
        "attention": _ms(lambda: attend(q, runner.kv.k, runner.kv.v), repeats),
        "head": _ms(lambda: head(params, x), repeats),
        "sampler": _ms(sample, repeats),
        "host": _ms(lay_out, repeats),
    }
