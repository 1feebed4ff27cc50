"""gpu_check step 4: full-model decode tokens/s of models.llama.forward with random weights,
per attention backend, weight format and KV dtype."""

from __future__ import annotations

from typing import Any

import numpy as np

from xlaserve.kernels.bench.timing import Clock, bench, record


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
