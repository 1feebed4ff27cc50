"""Tiny models and hand-built step batches for comparing a mesh against one device."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import AttentionMetadata, KVCache, Params, forward, init_params

# Head counts divide tensor sizes 2 and 4; 4 layers divide pipeline sizes 2 and 4.
TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                   num_heads=8, num_kv_heads=4, head_dim=16, tie_word_embeddings=False)
# 8 query heads over 2 KV heads: at tensor=4 the KV heads cannot be split.
TINY_GQA = TINY.replace(num_kv_heads=2, tie_word_embeddings=True)

BLOCK_SIZE = 4
NUM_BLOCKS = 16


def tiny_params(config: ModelConfig = TINY, seed: int = 0) -> Params:
    return init_params(config, seed, scale=0.1)


@dataclass(frozen=True)
class Step:
    tokens: np.ndarray        # [T] the flat batch: row 0's tokens, row 1's, ..., padding
    positions: np.ndarray     # [T]
    meta: AttentionMetadata
    logits_index: np.ndarray | None   # [R], or None: logits of every token


def make_step(tokens: list[list[int]], context: list[int], width: int,
              block_size: int = BLOCK_SIZE, all_logits: bool = False,
              pad_to: int | None = None) -> Step:
    """One step: row b appends `tokens[b]` after `context[b]` cached tokens; the flat batch
    is padded to `pad_to` tokens (default: none).

    Row b owns blocks [1 + b*width, 1 + (b+1)*width) (block 0 is the null block)."""
    b = len(tokens)
    n = sum(len(row) for row in tokens)
    t = pad_to or n
    ids = np.zeros(t, np.int32)
    pos = np.zeros(t, np.int32)
    rows = np.full(t, -1, np.int32)
    slots = np.zeros(t, np.int32)
    tables = np.array([[1 + r * width + i for i in range(width)] for r in range(b)], np.int32)
    index = np.zeros(b, np.int32)
    at = 0
    for r, row in enumerate(tokens):
        for i, token in enumerate(row):
            p = context[r] + i
            ids[at], pos[at], rows[at] = token, p, r
            slots[at] = tables[r, p // block_size] * block_size + p % block_size
            at += 1
        index[r] = at - 1
    meta = AttentionMetadata(jnp.asarray(tables), jnp.asarray(rows), jnp.asarray(slots))
    return Step(ids, pos, meta, None if all_logits else index)


def ragged_prefill(vocab: int, seed: int = 1) -> Step:
    """Four rows, ragged chunk lengths 7, 3, 5, 1 (16 tokens, padded to 20: microbatches
    of 5 tokens cut through rows); all logits."""
    rng = np.random.default_rng(seed)
    lens = [7, 3, 5, 1]
    rows = [rng.integers(0, vocab, n).tolist() for n in lens]
    return make_step(rows, [0, 0, 0, 0], width=3, all_logits=True, pad_to=20)


def decode_after_prefill(vocab: int, seed: int = 2) -> Step:
    """One new token per row of ragged_prefill's sequences; logits of that token."""
    rng = np.random.default_rng(seed)
    return make_step([[int(rng.integers(0, vocab))] for _ in range(4)], [7, 3, 5, 1], width=3)


def run(fwd, params: Params, config: ModelConfig, step: Step,
        kv: KVCache) -> tuple[np.ndarray, KVCache]:
    """One jitted step through `fwd` (models.llama.forward or a sharded forward)."""
    index = None if step.logits_index is None else jnp.asarray(step.logits_index)

    def go(params: Params, kv: KVCache) -> tuple[jax.Array, KVCache]:
        return fwd(params, config, jnp.asarray(step.tokens), jnp.asarray(step.positions), kv,
                   step.meta, logits_index=index)

    logits, kv = jax.jit(go)(params, kv)
    return np.asarray(logits), kv


def reference(params: Params, config: ModelConfig, steps: list[Step],
              kv: KVCache) -> list[tuple[np.ndarray, KVCache]]:
    """One-device logits and caches after each step."""
    out = []
    for step in steps:
        logits, kv = run(forward, params, config, step, kv)
        out.append((logits, kv))
    return out


def used_blocks(kv: KVCache) -> tuple[np.ndarray, np.ndarray]:
    """The cache without block 0, where padding tokens write (in no defined order)."""
    return np.asarray(kv.k)[:, 1:], np.asarray(kv.v)[:, 1:]


def assert_folder_matches_one_device(folder, mesh_config) -> None:
    """A converted model folder restored into `mesh_config`'s layout: ragged prefill rows
    (pipeline microbatches cut through rows), then a decode step, give the one-device logits
    and used KV blocks (within 1e-5 of their scale)."""
    from xlaserve.checkpoints.store import load_config, load_params
    from xlaserve.models.llama import init_kv_cache
    from xlaserve.sharding.layout import ShardLayout
    from xlaserve.sharding.mesh import make_mesh
    from xlaserve.sharding.parallel_forward import make_sharded_forward

    config = load_config(folder)
    one = load_params(folder, config, make_mesh())
    steps = [ragged_prefill(config.vocab_size), decode_after_prefill(config.vocab_size)]
    expected = reference(one, config, steps, init_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE))
    mesh = make_mesh(mesh_config)
    layout = ShardLayout.create(config, mesh)
    fwd = make_sharded_forward(config, mesh)
    params = load_params(folder, config, mesh)
    kv = layout.init_kv_cache(mesh, NUM_BLOCKS, BLOCK_SIZE)
    for step, (want, want_kv) in zip(steps, expected):
        logits, kv = run(fwd, params, config, step, kv)
        np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5 * np.abs(want).max())
        for got, ref in zip(used_blocks(kv), used_blocks(want_kv)):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
