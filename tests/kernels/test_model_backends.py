"""models.llama.forward gives the same logits and cache with every attention backend."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import AttentionMetadata, forward, init_kv_cache, init_params


@pytest.mark.parametrize("backend", ["pallas", "cpu"])
def test_backend_matches_reference_for_a_mixed_step_and_a_decode_step(backend):
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=16)
    params = init_params(config, seed=0, scale=0.2)
    bs, num_blocks = 8, 8
    # One flat batch: row 0 a 7-token chunk after a 5-token prefix (blocks 3, 5), row 1 a
    # 4-token prompt (block 2), then 5 padding tokens (row -1, slot 0: the null block).
    tables = np.asarray([[3, 5], [2, 0]], np.int32)
    rows = np.asarray([0] * 7 + [1] * 4 + [-1] * 5, np.int32)
    positions = np.asarray(list(range(5, 12)) + list(range(4)) + [0] * 5, np.int32)
    slots = np.where(rows >= 0, tables[np.maximum(rows, 0), positions // bs] * bs
                     + positions % bs, 0).astype(np.int32)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, len(rows)), jnp.int32)
    mixed = AttentionMetadata(jnp.asarray(tables), jnp.asarray(rows), jnp.asarray(slots))
    # Then a decode step: one token per row, at positions 12 and 4.
    decode = AttentionMetadata(jnp.asarray(tables), jnp.asarray([0, 1], jnp.int32),
                               jnp.asarray([5 * bs + 4, 2 * bs + 4], jnp.int32))

    results = {}
    for name in ("reference", backend):
        kv = init_kv_cache(config, num_blocks, bs)
        kv = kv._replace(k=kv.k + 0.5, v=kv.v - 0.5)  # stands in for the 5-token prefix
        logits, kv = forward(params, config, tokens, jnp.asarray(positions), kv, mixed,
                             logits_index=jnp.asarray([6, 10], jnp.int32),
                             attention_backend=name)
        step, kv = forward(params, config, tokens[:2], jnp.asarray([12, 4], jnp.int32), kv,
                           decode, logits_index=jnp.asarray([0, 1], jnp.int32),
                           attention_backend=name)
        results[name] = (np.asarray(logits), np.asarray(step), np.asarray(kv.k))

    ref, got = results["reference"], results[backend]
    for g, want in zip(got, ref):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
    assert np.abs(ref[1]).max() > 0.1  # logits are not trivially zero
