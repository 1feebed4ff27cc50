"""Random paged-attention inputs for the kernel tests.

Each row's blocks are drawn from a shuffled pool (tables are not contiguous), the cache holds
every layer, and every slot that no row may read is filled with large garbage, so a kernel that
reads past a length or through a wrong block id produces a visibly wrong answer."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

GARBAGE = 300.0
NUM_LAYERS = 2
LAYER = 1


@dataclass
class Case:
    q: jnp.ndarray             # [B, T, H, D]
    k_cache: jnp.ndarray       # [L, N, bs, KVH, D]
    v_cache: jnp.ndarray
    block_tables: jnp.ndarray  # [B, W] int32
    q_lens: jnp.ndarray        # [B] int32
    kv_lens: jnp.ndarray       # [B] int32
    layer: jnp.ndarray         # [] int32
    scale: float


def make_case(seed: int, *, q_lens: list[int], prefixes: list[int], chunk: int, heads: int,
              kv_heads: int, head_dim: int, block_size: int, dtype, width: int | None = None,
              spare_blocks: int = 3) -> Case:
    rng = np.random.default_rng(seed)
    b = len(q_lens)
    kv_lens = [q + p for q, p in zip(q_lens, prefixes)]
    need = [-(-n // block_size) for n in kv_lens]
    w = width or max(1, max(need))
    num_blocks = sum(need) + spare_blocks
    pool = rng.permutation(num_blocks)
    shape = (NUM_LAYERS, num_blocks, block_size, kv_heads, head_dim)
    k = np.full(shape, GARBAGE, np.float32)
    v = np.full(shape, -GARBAGE, np.float32)
    tables = np.zeros((b, w), np.int32)
    used = 0
    for row, n in enumerate(kv_lens):
        ids = pool[used:used + need[row]]
        used += need[row]
        tables[row, :len(ids)] = ids
        # Entries past the row's blocks point at arbitrary (valid) blocks, as stale tables do.
        tables[row, len(ids):] = rng.integers(0, num_blocks, w - len(ids))
        for j, blk in enumerate(ids):
            fill = min(block_size, n - j * block_size)
            k[:, blk, :fill] = rng.standard_normal((NUM_LAYERS, fill, kv_heads, head_dim))
            v[:, blk, :fill] = rng.standard_normal((NUM_LAYERS, fill, kv_heads, head_dim))
    q = rng.standard_normal((b, chunk, heads, head_dim))
    return Case(q=jnp.asarray(q, dtype), k_cache=jnp.asarray(k, dtype),
                v_cache=jnp.asarray(v, dtype), block_tables=jnp.asarray(tables),
                q_lens=jnp.asarray(q_lens, jnp.int32), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                layer=jnp.int32(LAYER), scale=head_dim ** -0.5)


def rel_error(out, ref) -> float:
    """max |out - ref| / max |ref|, in float64; NaN anywhere (an unwritten row) -> inf."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def tolerance(dtype) -> float:
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2


@dataclass
class FlatCase:
    """A Case laid out as one flat batch: each row's q_lens[b] real query tokens in row order,
    then `padding` padding tokens (row -1)."""

    q: jnp.ndarray             # [T, H, D]
    k_flat: jnp.ndarray        # [L*N*bs, KVH, D]
    v_flat: jnp.ndarray
    token_rows: jnp.ndarray    # [T] int32
    positions: jnp.ndarray     # [T] int32
    block_tables: jnp.ndarray  # [B, W] int32
    layer: jnp.ndarray
    num_blocks: int
    block_size: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_flat, self.v_flat, self.layer, self.token_rows, self.positions,
                self.block_tables)

    def kw(self) -> dict:
        return dict(num_blocks=self.num_blocks, block_size=self.block_size, scale=self.scale)


def to_flat(case: Case, padding: int = 0) -> tuple[FlatCase, np.ndarray]:
    """The flat form of `case` and, per flat token, its (row, slot) in case.q ((-1, 0) for
    padding), to compare with the padded kernels."""
    q = np.asarray(case.q)
    q_lens, kv_lens = np.asarray(case.q_lens), np.asarray(case.kv_lens)
    picks, rows, positions = [], [], []
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        for t in range(n):
            picks.append((b, t))
            rows.append(b)
            positions.append(kv - n + t)
    picks += [(-1, 0)] * padding
    rows += [-1] * padding
    positions += [0] * padding
    pick = np.asarray(picks, np.int64).reshape(-1, 2)
    flat_q = np.where((pick[:, 0] >= 0)[:, None, None], q[pick[:, 0], pick[:, 1]], 0)
    _, num_blocks, bs, kvh, d = case.k_cache.shape
    return FlatCase(q=jnp.asarray(flat_q, case.q.dtype),
                    k_flat=case.k_cache.reshape(-1, kvh, d),
                    v_flat=case.v_cache.reshape(-1, kvh, d),
                    token_rows=jnp.asarray(rows, jnp.int32),
                    positions=jnp.asarray(positions, jnp.int32),
                    block_tables=case.block_tables, layer=case.layer, num_blocks=num_blocks,
                    block_size=bs, scale=case.scale), pick
