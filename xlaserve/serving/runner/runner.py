"""The model runner: step plans in, sampled tokens out, over device-resident state.

    rows (host: token ids, positions, block tables, sampling params)
      -> pad to a bucket (rows, tokens, width) -> two AOT-compiled calls:
         forward  tokens[PENDING] <- token_slots[row_slot]  (the token sampled last step)
                  logits, kv = model.forward(...)          (kv donated: updated in place)
         sample   out = sample(logits)                      (per-row seeded sampling)
                  token_slots[row_slot] <- out.tokens       (for the next step's PENDING)
      -> device arrays, fetched by the caller when it needs them

The forward is compiled per (rows, tokens, width) bucket, the sampler once per row count: the
sampler's sort is as costly to compile as the model, and depends on the rows alone.

The runner owns the device KV cache and the token-slot array: both go into every call and come
back out.  Every bucket is compiled in `warmup()`; a shape outside the plan raises instead of
compiling, so serving never compiles.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import KV_AXES, AttentionMetadata, KVCache, Params, forward
from xlaserve.serving.runner.buckets import BucketPlan
from xlaserve.serving.runner.sampling import SampleOutput, SamplingArrays, sample
from xlaserve.sharding.rules import named_sharding

PENDING = -1  # a token id still on device: the row's previous sampled token


@dataclass(frozen=True)
class RowSampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    counter: int = 0              # index of the token this row samples (RNG stream position)
    bias: np.ndarray | None = None  # [V] additive logit bias (penalties), None = zeros


GREEDY = RowSampling()


@dataclass(frozen=True)
class RowInput:
    """One sequence's share of a call."""

    token_ids: Sequence[int]      # PENDING entries are filled from the sequence's token slot
    start_position: int           # position of token_ids[0]
    block_table: Sequence[int]    # covers positions [0, start_position + len(token_ids))
    slot: int                     # the sequence's token slot, in [1, max_num_seqs]
    sample: bool = True           # does this row produce a token (end of prompt, decode)?
    sampling: RowSampling = GREEDY


@dataclass(frozen=True)
class CallResult:
    """Device outputs of one call; `rows` of them are real, the rest padding."""

    rows: int
    out: SampleOutput

    def fetch(self) -> dict[str, np.ndarray]:
        host = jax.device_get(self.out)
        return {name: np.asarray(v)[: self.rows] for name, v in host._asdict().items()}


def _forward_step(params: Params, kv: KVCache, token_slots: jax.Array, tokens: jax.Array,
                  positions: jax.Array, meta: AttentionMetadata, logits_index: jax.Array,
                  row_slot: jax.Array, *, config: ModelConfig,
                  backend: str) -> tuple[KVCache, jax.Array]:
    # tokens, positions: [R, T]; logits_index, row_slot: [R] -> logits [R, V]
    pending = token_slots[row_slot][:, None]                            # [R, 1]
    tokens = jnp.where(tokens == PENDING, pending, tokens)
    logits, kv = forward(params, config, tokens, positions, kv, meta,
                         logits_index=logits_index, attention_backend=backend)
    return kv, logits


def _sample_step(logits: jax.Array, token_slots: jax.Array, row_slot: jax.Array,
                 sample_mask: jax.Array, sampling: SamplingArrays
                 ) -> tuple[jax.Array, SampleOutput]:
    # logits: [R, V]; row_slot, sample_mask: [R]
    out = sample(logits, sampling)
    token_slots = token_slots.at[jnp.where(sample_mask, row_slot, 0)].set(out.tokens)
    return token_slots, out


class ModelRunner:
    def __init__(self, params: Params, config: ModelConfig, mesh: Mesh, *, num_blocks: int,
                 block_size: int, max_num_seqs: int, buckets: BucketPlan,
                 attention_backend: str = "reference", kv_dtype: str | None = None):
        self.params = params
        self.config = config
        self.mesh = mesh
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.buckets = buckets
        self.backend = attention_backend
        self.replicated = NamedSharding(mesh, PartitionSpec())
        kv_sharding = named_sharding(mesh, KV_AXES)
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        dtype = jnp.dtype(kv_dtype or config.dtype)
        self._new_kv = jax.jit(lambda: KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                               out_shardings=KVCache(kv_sharding, kv_sharding))
        self.reset_state()
        self._zero_bias: dict[int, jax.Array] = {}
        self._compiled: dict[tuple[int, int, int], Any] = {}
        self._compiled_sample: dict[int, Any] = {}
        self._jitted = jax.jit(_forward_step, static_argnames=("config", "backend"),
                               donate_argnames=("kv",))
        self._jitted_sample = jax.jit(_sample_step, donate_argnames=("token_slots",))
        self.warmup_seconds = 0.0

    def reset_state(self) -> None:
        """Fresh device state: an all-zero KV cache and token slots (at start, and after a
        failed call may have consumed the donated buffers)."""
        self.kv = self._new_kv()
        self.token_slots = self._put(np.zeros(self.max_num_seqs + 1, np.int32))

    # -- compilation ---------------------------------------------------------------------------

    def _spec(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def compile(self, shape: tuple[int, int, int]) -> Any:
        """The forward pass for bucket (rows, tokens, width), and the sampler for its rows."""
        r, t, w = shape
        spec, i32 = self._spec, jnp.int32
        if shape not in self._compiled:
            meta = AttentionMetadata(spec((r, w), i32), spec((r,), i32), spec((r,), i32),
                                     spec((r, t), i32))
            lowered = self._jitted.lower(self.params, self.kv, self.token_slots,
                                         spec((r, t), i32), spec((r, t), i32), meta,
                                         spec((r,), i32), spec((r,), i32),
                                         config=self.config, backend=self.backend)
            self._compiled[shape] = lowered.compile()
        if r not in self._compiled_sample:
            f32 = jnp.float32
            sampling = SamplingArrays(spec((r,), f32), spec((r,), i32), spec((r,), f32),
                                      spec((r,), f32), spec((r,), jnp.uint32), spec((r,), i32),
                                      spec((r, self.config.vocab_size), f32))
            logits = spec((r, self.config.vocab_size), f32)
            self._compiled_sample[r] = self._jitted_sample.lower(
                logits, self.token_slots, spec((r,), i32), spec((r,), jnp.bool_),
                sampling).compile()
        return self._compiled[shape]

    def warmup(self, shapes: Sequence[tuple[int, int, int]] | None = None) -> float:
        """Compile every bucket (or `shapes`); returns the seconds it took."""
        start = time.perf_counter()
        for shape in shapes if shapes is not None else self.buckets.shapes():
            self.compile(shape)
        self.warmup_seconds += time.perf_counter() - start
        return self.warmup_seconds

    @property
    def compiled_shapes(self) -> list[tuple[int, int, int]]:
        return sorted(self._compiled)

    # -- execution -----------------------------------------------------------------------------

    def run(self, rows: Sequence[RowInput], chunk: int) -> CallResult:
        """One call over `rows`, each feeding at most `chunk` tokens (1 for decode)."""
        n = len(rows)
        if chunk == 1:
            r = self.buckets.decode_rows(n)
            t = 1
        else:
            t = self.buckets.chunk(chunk)
            r = self.buckets.rows(t, n)
        w = self.buckets.width(max(len(row.block_table) for row in rows), t)
        if (r, t, w) not in self._compiled:
            raise RuntimeError(f"bucket (rows={r}, tokens={t}, width={w}) was not compiled in "
                               f"warm-up; compiled: {len(self._compiled)} buckets")
        bs = self.block_size
        tokens = np.zeros((r, t), np.int32)
        positions = np.zeros((r, t), np.int32)
        slots = np.zeros((r, t), np.int32)          # padding tokens write the null block
        tables = np.zeros((r, w), np.int32)
        q_lens = np.zeros(r, np.int32)
        kv_lens = np.zeros(r, np.int32)
        logits_index = np.zeros(r, np.int32)
        row_slot = np.zeros(r, np.int32)
        sample_mask = np.zeros(r, np.bool_)
        temperature = np.zeros(r, np.float32)
        top_k = np.zeros(r, np.int32)
        top_p = np.ones(r, np.float32)
        min_p = np.zeros(r, np.float32)
        seed = np.zeros(r, np.uint32)
        counter = np.zeros(r, np.int32)
        bias_rows: list[tuple[int, np.ndarray]] = []
        for i, row in enumerate(rows):
            k = len(row.token_ids)
            if not 0 < k <= t:
                raise ValueError(f"row {i} feeds {k} tokens, the call takes 1..{t}")
            table = np.asarray(row.block_table, np.int32)
            pos = np.arange(row.start_position, row.start_position + k, dtype=np.int32)
            if len(table) * bs < pos[-1] + 1:
                raise ValueError(f"row {i}: block table of {len(table)} blocks cannot hold "
                                 f"position {pos[-1]}")
            tokens[i, :k] = row.token_ids
            positions[i, :k] = pos
            slots[i, :k] = table[pos // bs] * bs + pos % bs
            tables[i, : len(table)] = table
            q_lens[i] = k
            kv_lens[i] = pos[-1] + 1
            logits_index[i] = k - 1
            row_slot[i] = row.slot
            sample_mask[i] = row.sample
            s = row.sampling
            temperature[i], top_k[i], top_p[i], min_p[i] = s.temperature, s.top_k, s.top_p, s.min_p
            seed[i], counter[i] = s.seed & 0xFFFFFFFF, s.counter
            if s.bias is not None:
                bias_rows.append((i, s.bias))
        if bias_rows:
            bias = np.zeros((r, self.config.vocab_size), np.float32)
            for i, b in bias_rows:
                bias[i] = b
            bias_dev = self._put(bias)
        else:
            bias_dev = self._zeros_bias(r)
        put = self._put
        meta = AttentionMetadata(put(tables), put(q_lens), put(kv_lens), put(slots))
        sampling = SamplingArrays(put(temperature), put(top_k), put(top_p), put(min_p),
                                  put(seed), put(counter), bias_dev)
        dev_slot = put(row_slot)
        self.kv, logits = self._compiled[(r, t, w)](
            self.params, self.kv, self.token_slots, put(tokens), put(positions), meta,
            put(logits_index), dev_slot)
        self.token_slots, out = self._compiled_sample[r](
            logits, self.token_slots, dev_slot, put(sample_mask), sampling)
        return CallResult(n, out)

    def _put(self, a: np.ndarray) -> jax.Array:
        return jax.device_put(a, self.replicated)

    def _zeros_bias(self, r: int) -> jax.Array:
        if r not in self._zero_bias:
            self._zero_bias[r] = self._put(np.zeros((r, self.config.vocab_size), np.float32))
        return self._zero_bias[r]
