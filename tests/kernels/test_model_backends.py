"""models.llama.forward gives the same logits with attention_backend="pallas" as "reference"."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import AttentionMetadata, forward, init_kv_cache, init_params


def test_pallas_backend_matches_reference_for_prefill_and_decode():
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=16)
    params = init_params(config, seed=0, scale=0.2)
    bs, num_blocks = 8, 8
    # Row 0: a 7-token chunk after a 5-token prefix (blocks 3, 5); row 1: a 4-token prompt
    # (block 2), padded to T = 7.  Block 0 is the null block that padding writes to.
    tables = jnp.asarray([[3, 5], [2, 0]], jnp.int32)
    q_lens, kv_lens = np.array([7, 4]), np.array([12, 4])
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 7)), jnp.int32)
    positions = np.zeros((2, 7), np.int32)
    slots = np.zeros((2, 7), np.int32)
    for row in range(2):
        for t in range(q_lens[row]):
            pos = kv_lens[row] - q_lens[row] + t
            positions[row, t] = pos
            slots[row, t] = int(tables[row, pos // bs]) * bs + pos % bs
    prefill_meta = AttentionMetadata(tables, jnp.asarray(q_lens, jnp.int32),
                                     jnp.asarray(kv_lens, jnp.int32), jnp.asarray(slots))
    decode_meta = AttentionMetadata(
        tables, jnp.asarray([1, 1], jnp.int32), jnp.asarray(kv_lens + 1, jnp.int32),
        jnp.asarray([[5 * bs + 4], [2 * bs + 4]], jnp.int32))

    results = {}
    for backend in ("reference", "pallas"):
        kv = init_kv_cache(config, num_blocks, bs)
        kv = kv._replace(k=kv.k + 0.5, v=kv.v - 0.5)  # stands in for the 5-token prefix
        logits, kv = forward(params, config, tokens, jnp.asarray(positions), kv, prefill_meta,
                             attention_backend=backend)
        step, kv = forward(params, config, tokens[:, :1], jnp.asarray(kv_lens[:, None]), kv,
                           decode_meta, attention_backend=backend)
        results[backend] = (np.asarray(logits), np.asarray(step), np.asarray(kv.k))

    ref, pallas = results["reference"], results["pallas"]
    for got, want in zip(pallas, ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(ref[1]).max() > 0.1  # logits are not trivially zero
