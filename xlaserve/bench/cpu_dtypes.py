"""Forward-step time by parameter / KV-cache dtype, and the cost of one KV-cache write.

    python -m xlaserve.bench.cpu_dtypes --model .models/smollm2-135m-instruct

Random weights of the model's shapes (timing does not depend on their values); decode steps of
1 and 8 rows over a 48-block table with 512 cached tokens, the cache donated as in serving.
Written to show why `load_model` warns about bf16 / f16 on the CPU backend.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.bench.roofline import median_seconds
from xlaserve.checkpoints.store import load_config
from xlaserve.models import llama
from xlaserve.models.batch_metadata import decode_metadata


def step_ms(config, kv_dtype: str, rows: int, width: int = 48, kv_len: int = 512,
            block_size: int = 16, repeats: int = 5) -> float:
    """Median wall time (ms) of one decode step of `rows` rows."""
    num_blocks = rows * width + 1
    params = jax.device_put(llama.init_params(config))
    kv = llama.init_kv_cache(config, num_blocks, block_size, dtype=kv_dtype)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, kv, tokens, positions, meta):
        return llama.forward(params, config, tokens, positions, kv, meta,
                             logits_index=jnp.zeros((rows,), jnp.int32))

    tables = 1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    pos = np.full(rows, kv_len - 1, np.int32)
    meta = llama.AttentionMetadata(*(jnp.asarray(a) for a in
                                     decode_metadata(tables, pos, block_size)))
    tokens = jnp.ones(rows, jnp.int32)

    def one_step() -> None:
        nonlocal kv
        logits, kv = step(params, kv, tokens, jnp.asarray(pos), meta)
        logits.block_until_ready()

    return 1e3 * median_seconds(one_step, repeats)   # after one untimed call (it compiles)


def scatter_ms(dtype: str, tokens: int = 8, repeats: int = 5) -> float:
    """Median time (ms) to write `tokens` rows into a donated SmolLM2-sized flat cache."""
    shape = (30 * 1537 * 16, 3, 64)
    write = jax.jit(lambda cache, new, at: cache.at[at].set(new, mode="drop"),
                    donate_argnums=0)
    cache = jnp.zeros(shape, dtype)
    new = jnp.ones((tokens, *shape[1:]), dtype)
    at = jnp.arange(tokens, dtype=jnp.int32) * 37

    def one_write() -> None:
        nonlocal cache
        cache = write(cache, new, at)
        cache.block_until_ready()

    return 1e3 * median_seconds(one_write, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=".models/smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,8")
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}, jax {jax.__version__}")
    for dtype in ("float32", "float16", "bfloat16"):
        print(f"KV write of 8 tokens, {dtype} cache: {scatter_ms(dtype):.2f} ms")
    rows = [int(r) for r in args.rows.split(",")]
    for params_dtype, kv_dtype in (("float32", "float32"), ("float16", "float16"),
                                   ("bfloat16", "float32"), ("bfloat16", "bfloat16")):
        config = load_config(args.model, params_dtype)
        repeats = 2 if kv_dtype == "bfloat16" else 5  # seconds per step there
        times = ", ".join(f"{r} rows {step_ms(config, kv_dtype, r, repeats=repeats):.1f} ms"
                          for r in rows)
        print(f"params {params_dtype:8s} cache {kv_dtype:8s}: {times}", flush=True)


if __name__ == "__main__":
    main()
