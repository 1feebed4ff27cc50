"""The Llama forward on any `pipeline x expert x tensor` mesh, with models.llama.forward's
signature.

Every device runs one program under `shard_map` over every mesh axis, on its own slices:

    tokens [T] (replicated; the runner's flat batch, see models/llama.py)
      -> embed       vocab rows split over `tensor`: local lookup, psum(tensor)    -> x [T, E]
      -> split tokens into M microbatches of T/M consecutive tokens               -> [M, T/M, E]
      -> pipeline    for tick in 0 .. M + P - 2:            (P = pipeline stages)
                       stage s works on microbatch tick - s (a bubble when out of range):
                       stage 0 reads the embedding, stage s > 0 what stage s-1 sent last tick;
                       runs its L/P layers (models.llama.decoder_layers, Megatron TP inside:
                       local heads / mlp slice, psum(tensor) after wo and after w_down;
                       a MoE layer runs its shard's experts on every token, psum(expert,
                       tensor) after them: see "Expert parallelism" below);
                       collective-permute(pipeline) the result to stage s + 1 (stage 0
                       receives nothing: it reads the next microbatch's embedding).
                     The last stage keeps each row's logits token (or every token) from the
                     microbatch holding it; one psum(pipeline) hands the [R, E] (or [T, E])
                     result to every stage.
      -> final norm, logits over the local vocab slice                 -> logits [R or T, V/tp]
         (a global array sharded over `tensor` on the vocab axis; nothing is gathered)

The KV cache [L, N, bs, K, D] is split over `pipeline` on layers (each stage owns its layers'
cache) and over `tensor` on KV heads when the layout splits them.  Bubble ticks write their KV
to a slot outside the cache, which the scatter drops, so the cache comes out as on one device.
Splitting the flat batch keeps attention causal: a stage runs microbatch j after j - 1, so a
token's earlier positions in the same step (an earlier microbatch) are in the cache already.

Why shard_map + ppermute rather than one compiled function per stage driven by the host: one
compiled step keeps the runner's contract (one call per step, donated KV, no host round trip
between stages) and lets stages overlap on different microbatches inside the device program; the
host-driven variant pays a dispatch and a device-to-device copy per stage per microbatch from
Python.  The price is the bubble: with M microbatches each stage runs M + P - 1 ticks for M
ticks of work, so the step costs (M + P - 1)/M stage-times instead of P (M = P by default).

Expert parallelism (a MoE model, mesh `expert` > 1): the stacked experts [L, X, E, F] are split
over `expert` (and F over `tensor`); attention, norms, router and the KV cache are replicated
over `expert` (the expert ranks of one tensor shard compute the same attention).  Dispatch is the
"all-gather + local experts + reduce" form with the all-gather free: the flat batch is already
replicated on every device, so each shard routes every token, runs the pairs routed to its own
experts (models/moe.py, dropless grouped matmuls) and one psum over (expert, tensor) per layer
combines the partial outputs, the dense MLP's psum(tensor) widened to the expert ranks.  An
all-to-all would first need the tokens split over `expert` (data parallel attention), which this
layout does not have; at serving batch sizes the psum of a [T, E] activation is small next to
the expert weights, which never move.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlaserve.kernels.attention import attention
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import (
    AttentionMetadata,
    CacheGeometry,
    KVCache,
    Params,
    decoder_layers,
    final_logits,
    forward,
    scale_embeddings,
)
from xlaserve.models.moe import ONE_DEVICE, ExpertShard
from xlaserve.sharding.layout import ShardLayout

Forward = Callable[..., tuple[jax.Array, KVCache]]


def _shard_map(f: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
    """shard_map over every mesh axis, without replication checking.

    Unchecked because the pipeline's loop carries change from replicated to per-stage values,
    and the call that marks them (pvary / pcast) differs between jax releases.  Replication of
    the outputs is ensured by construction (psum over the axes they are replicated on)."""
    if hasattr(jax, "shard_map"):   # jax >= 0.7 (0.10 here, 0.11 on the GPU machines)
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def microbatch_count(batch: int, wanted: int) -> int:
    """The largest divisor of `batch` that is at most `wanted` (tokens split evenly)."""
    return max(m for m in range(1, min(batch, wanted) + 1) if batch % m == 0)


def make_forward(config: ModelConfig, mesh: Mesh, *,
                 num_microbatches: int | None = None) -> Forward:
    """The forward for `mesh`: models.llama.forward itself on one device, else the shard_map
    program below (make_sharded_forward); the caller need not tell the cases apart."""
    if mesh.devices.size == 1:
        return forward
    return make_sharded_forward(config, mesh, num_microbatches=num_microbatches)


def make_sharded_forward(config: ModelConfig, mesh: Mesh, *,
                         num_microbatches: int | None = None) -> Forward:
    """A forward with models.llama.forward's signature that runs on `mesh`.

    `params` and `kv` should already be placed by ShardLayout.create(config, mesh) (else jit
    moves them on every call).  Tokens are split into `num_microbatches` (default: the number
    of pipeline stages; fewer when the batch does not divide) so that stages overlap.
    Raises ValueError at construction if the model cannot be laid out on the mesh."""
    layout = ShardLayout.create(config, mesh)
    pp = layout.mesh.pipeline
    wanted = num_microbatches or pp
    if wanted < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    param_specs = layout.param_specs()
    kv_spec = layout.kv_spec()

    def forward(params: Params, config_: ModelConfig, tokens: jax.Array, positions: jax.Array,
                kv: KVCache, meta: AttentionMetadata, *, logits_index: jax.Array | None = None,
                attention_backend: str = "auto") -> tuple[jax.Array, KVCache]:
        if config_ != config:
            raise ValueError("this sharded forward was built for another ModelConfig")
        t = tokens.shape[0]
        m = microbatch_count(t, wanted) if pp > 1 else 1
        all_tokens = logits_index is None
        if all_tokens:
            logits_index = jnp.zeros((1,), jnp.int32)
        vocab = "tensor" if layout.vocab_split else None
        logits_spec = P(None, vocab)
        body = functools.partial(_device_step, layout, m, all_tokens, attention_backend)
        step = _shard_map(body, mesh,
                          in_specs=(param_specs, P(), P(), kv_spec, kv_spec, P(), P()),
                          out_specs=(logits_spec, kv_spec, kv_spec))
        logits, k, v = step(params, tokens, positions, kv.k, kv.v, meta, logits_index)
        return logits, KVCache(k, v)

    return forward


# -- the per-device program ---------------------------------------------------------------------


def _device_step(layout: ShardLayout, m: int, all_tokens: bool, attention_backend: str,
                 params: Params,
                 tokens: jax.Array,        # [T]
                 positions: jax.Array,     # [T]
                 k_cache: jax.Array,       # [L/P, N, bs, K_local, D] this device's slice
                 v_cache: jax.Array,
                 meta: AttentionMetadata,  # every token's metadata (replicated)
                 logits_index: jax.Array,  # [R]
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    c = layout.model
    pp, tp = layout.mesh.pipeline, layout.mesh.tensor
    cache_shape = k_cache.shape
    num_blocks, block_size, kvh, d = cache_shape[1:]
    geometry = CacheGeometry(num_blocks, block_size)

    def reduce(y: jax.Array) -> jax.Array:
        return lax.psum(y, "tensor") if tp > 1 else y

    experts = _expert_shard(layout) if c.is_moe else ONE_DEVICE

    # this stage's first layer in the model (Gemma's layers pick their kind by it)
    first_layer = lax.axis_index("pipeline") * cache_shape[0] if pp > 1 else 0
    attend = attention
    if tp > 1 and not layout.kv_heads_split:
        attend = functools.partial(_attend_with_replicated_kv, c.num_heads)

    def run_stage(x: jax.Array, positions: jax.Array, meta: AttentionMetadata,
                  k_flat: jax.Array, v_flat: jax.Array) -> tuple[jax.Array, ...]:
        """This stage's layers over one microbatch; x [t, E], k_flat [L/P*N*bs, K, D]."""
        return decoder_layers(c, params["layers"], x, k_flat, v_flat, positions, meta,
                              geometry, attention_backend=attention_backend, attend=attend,
                              reduce=reduce, experts=experts, first_layer=first_layer)

    x = scale_embeddings(c, _embed(params["embed"], tokens, layout.vocab_split))   # [T, E]
    k_flat = k_cache.reshape(-1, kvh, d)                                # [L/P*N*bs, K, D]
    v_flat = v_cache.reshape(-1, kvh, d)
    if pp == 1:
        x, k_flat, v_flat = run_stage(x, positions, meta, k_flat, v_flat)
        hidden = x if all_tokens else x[logits_index]
    else:
        hidden, k_flat, v_flat = _pipeline(
            run_stage, all_tokens, m, pp, x, positions, meta, logits_index, k_flat, v_flat)

    logits = final_logits(params, c, hidden, attention_backend)        # [R or T, V/tp]
    return logits, k_flat.reshape(cache_shape), v_flat.reshape(cache_shape)


def _expert_shard(layout: ShardLayout) -> ExpertShard:
    """This device's experts and the sum of MoE partial outputs over expert and tensor shards
    (expert rank 0 adds the shared expert, which every rank holds)."""
    axes = tuple(a for a, n in (("expert", layout.mesh.expert), ("tensor", layout.mesh.tensor))
                 if n > 1)

    def reduce(y: jax.Array) -> jax.Array:
        return lax.psum(y, axes)

    if not layout.experts_split:
        return ExpertShard(0, True, reduce if axes else None)
    rank = lax.axis_index("expert")
    return ExpertShard(rank * layout.experts_per_shard, rank == 0, reduce)


def _embed(table: jax.Array,   # [V/tp, E] this shard's vocabulary rows
           tokens: jax.Array,  # [T]
           vocab_split: bool) -> jax.Array:  # [T, E]
    if not vocab_split:
        return table[tokens]
    rows = table.shape[0]
    local = tokens - lax.axis_index("tensor") * rows
    inside = (local >= 0) & (local < rows)
    x = jnp.where(inside[..., None], table[jnp.clip(local, 0, rows - 1)], 0)
    return lax.psum(x, "tensor")   # exactly one shard holds each token's row: the sum is exact


def _attend_with_replicated_kv(num_heads: int, q: jax.Array, k_flat: jax.Array,
                               v_flat: jax.Array, layer: jax.Array, token_rows: jax.Array,
                               positions: jax.Array, block_tables: jax.Array,
                               **kw: Any) -> jax.Array:
    """Attention for this shard's query heads when every shard holds all KV heads.

    q: [T, H/tp, D] holds global heads [s*H/tp, (s+1)*H/tp).  The heads are put back at
    their global positions in a zero [T, H, D] query so that the GQA grouping of any kernel
    (query head h reads KV head h // (H/K)) stays right, and this shard's heads are cut out of
    the result.  Heads are independent, so the zero heads change nothing; they cost attention
    FLOPs (x tp), which a kernel taking a head offset would remove."""
    t, local, d = q.shape
    start = lax.axis_index("tensor") * local
    full = jnp.zeros((t, num_heads, d), q.dtype)
    full = lax.dynamic_update_slice_in_dim(full, q, start, axis=1)
    out = attention(full, k_flat, v_flat, layer, token_rows, positions, block_tables,
                    **kw)                                                # [T, H, D]
    return lax.dynamic_slice_in_dim(out, start, local, axis=1)


def _pipeline(run_stage: Callable[..., tuple[jax.Array, ...]], all_tokens: bool,
              m: int, pp: int,
              x: jax.Array,              # [T, E] embeddings (used by stage 0)
              positions: jax.Array,      # [T]
              meta: AttentionMetadata,
              logits_index: jax.Array,   # [R]
              k_flat: jax.Array, v_flat: jax.Array,
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GPipe-style forward schedule over `m` microbatches of tokens and `pp` stages.

    tick:      0    1    2    3    4          (m = 3, pp = 3)
    stage 0:  mb0  mb1  mb2   -    -
    stage 1:   -   mb0  mb1  mb2   -
    stage 2:   -    -   mb0  mb1  mb2   -> finished microbatches kept by the last stage
    """
    t = x.shape[0]
    n = t // m                                                          # tokens per microbatch

    def split(a: jax.Array) -> jax.Array:                               # [T, ...] -> [m, T/m, ...]
        return a.reshape(m, n, *a.shape[1:])

    xs, pos_mb = split(x), split(positions)
    rows_mb, slots_mb = split(meta.token_rows), split(meta.slot_mapping)
    stage = lax.axis_index("pipeline")
    is_last = stage == pp - 1
    drop_slot = jnp.int32(k_flat.shape[0])  # beyond every layer's slots: the write is dropped
    shift = [(s, s + 1) for s in range(pp - 1)]  # the last stage sends nothing back

    def keep(y: jax.Array, j: jax.Array, outs: jax.Array, valid: jax.Array) -> jax.Array:
        """Fold microbatch j's output y [T/m, E] into the kept result."""
        if all_tokens:
            done = jnp.where(valid & is_last, y, outs[j])
            return lax.dynamic_update_index_in_dim(outs, done, j, axis=0)
        local = logits_index - j * n                                    # [R]
        mine = valid & is_last & (local >= 0) & (local < n)             # rows picked from mb j
        return jnp.where(mine[:, None], y[jnp.clip(local, 0, n - 1)], outs)

    def tick(carry: tuple[jax.Array, ...], tick_index: jax.Array) -> tuple[Any, None]:
        received, k_flat, v_flat, outs = carry
        mb = tick_index - stage
        valid = (mb >= 0) & (mb < m)
        j = jnp.clip(mb, 0, m - 1)
        inp = jnp.where(stage == 0, xs[j], received)                   # [T/m, E]
        meta_j = AttentionMetadata(meta.block_tables, rows_mb[j],
                                   jnp.where(valid, slots_mb[j], drop_slot))
        y, k_flat, v_flat = run_stage(inp, pos_mb[j], meta_j, k_flat, v_flat)
        outs = keep(y, j, outs, valid)
        received = lax.ppermute(y, "pipeline", shift)
        return (received, k_flat, v_flat, outs), None

    outs = jnp.zeros((m, n, x.shape[1]) if all_tokens else (logits_index.shape[0], x.shape[1]),
                     x.dtype)
    carry = (jnp.zeros_like(xs[0]), k_flat, v_flat, outs)
    (_, k_flat, v_flat, outs), _ = lax.scan(tick, carry, jnp.arange(m + pp - 1))
    hidden = lax.psum(jnp.where(is_last, outs, 0), "pipeline")        # only the last stage's
    return (hidden.reshape(t, -1) if all_tokens else hidden), k_flat, v_flat
