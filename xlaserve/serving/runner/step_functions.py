"""The two functions every device call runs, compiled per bucket by the runner: the forward
over a step's packed inputs (HostStep.packed) and the sampler.

    forward_step  tokens[PENDING_TOKEN] <- token_cells[row_cell[row]]   (sampled last step)
                  logits [R, V], kv = forward(...)                      (kv donated)
    sample_step   out = sample(logits, allowed-token mask)
                  rows verifying a draft model's sampled drafts: accept or resample
                  (draft_verify.py);  token_cells[row_cell] <- out.tokens
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import AttentionMetadata, KVCache, Params
from xlaserve.serving.runner.draft_verify import verify_drafts
from xlaserve.serving.runner.sampling import SampleOutput, SamplingArrays, sample
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN
from xlaserve.sharding.parallel_forward import Forward


def forward_step(params: Params, kv: KVCache, token_cells: jax.Array, rows: jax.Array,
                 toks: jax.Array, tables: jax.Array, *, forward: Forward,
                 config: ModelConfig, backend: str, replicated: NamedSharding | None
                 ) -> tuple[KVCache, jax.Array]:
    # rows: [ROW_FIELDS, R], toks: [TOKEN_FIELDS, T], tables: [R, W] (HostStep.packed)
    tokens, positions, token_rows, slot_mapping = toks
    logits_index, row_cell = rows[0], rows[1]
    meta = AttentionMetadata(tables, token_rows, slot_mapping)
    pending = token_cells[row_cell[jnp.clip(token_rows, 0, None)]]  # [T]
    tokens = jnp.where(tokens == PENDING_TOKEN, pending, tokens)
    logits, kv = forward(params, config, tokens, positions, kv, meta,
                         logits_index=logits_index, attention_backend=backend)  # [R, V(/tp)]
    if replicated is not None:   # gather the vocab shards: the sampler sees whole rows
        logits = jax.lax.with_sharding_constraint(logits, replicated)   # [R, V]
    return kv, logits


def sample_step(logits: jax.Array, token_cells: jax.Array, rows: jax.Array, bias: jax.Array,
                allowed: jax.Array, draft_probs: jax.Array) -> tuple[jax.Array, SampleOutput]:
    # logits: [R, V]; rows: [ROW_FIELDS, R] (HostStep.packed); bias: [R, V];
    # allowed: [R, ceil(V/32)] int32 packed allowed-token mask (token_mask.py);
    # draft_probs: [R, V] the draft distribution of rows with a draft_token (else unread)
    sampling = sampling_arrays(rows, bias)
    draft_token, sample_mask, row_cell = rows[-1], rows[2], rows[1]
    out = verify_drafts(logits, sampling, allowed, sample(logits, sampling, allowed),
                        draft_token, draft_probs)
    token_cells = token_cells.at[jnp.where(sample_mask != 0, row_cell, 0)].set(out.tokens)
    return token_cells, out


def sampling_arrays(rows: jax.Array, bias: jax.Array) -> SamplingArrays:
    """The sampling fields of HostStep.packed's row buffer [ROW_FIELDS, R]."""
    def f32(x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x, jnp.float32)

    (_, _, _, temperature, top_k, top_p, min_p, seed, counter, logprobs, _) = rows
    return SamplingArrays(f32(temperature), top_k, f32(top_p), f32(min_p),
                          jax.lax.bitcast_convert_type(seed, jnp.uint32), counter, bias,
                          logprobs != 0)
