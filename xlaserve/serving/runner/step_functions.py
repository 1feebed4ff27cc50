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
import numpy as np
from jax.sharding import NamedSharding

from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import AttentionMetadata, KVCache, Params
from xlaserve.serving.runner.draft_verify import verify_drafts
from xlaserve.serving.runner.host_step import ROW_FIELDS, TOKEN_FIELDS, Field
from xlaserve.serving.runner.sampling import SampleOutput, SamplingArrays, sample
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN
from xlaserve.sharding.parallel_forward import Forward


def forward_step(params: Params, kv: KVCache, token_cells: jax.Array, rows: jax.Array,
                 toks: jax.Array, tables: jax.Array, *, forward: Forward,
                 config: ModelConfig, backend: str, replicated: NamedSharding | None
                 ) -> tuple[KVCache, jax.Array]:
    # rows: [len(ROW_FIELDS), R], toks: [len(TOKEN_FIELDS), T], tables: [R, W]
    # (HostStep.packed)
    tok, row = unpack(toks, TOKEN_FIELDS), unpack(rows, ROW_FIELDS)
    token_rows = tok["token_rows"]
    meta = AttentionMetadata(tables, token_rows, tok["slot_mapping"])
    pending = token_cells[row["row_cell"][jnp.clip(token_rows, 0, None)]]  # [T]
    tokens = jnp.where(tok["tokens"] == PENDING_TOKEN, pending, tok["tokens"])
    logits, kv = forward(params, config, tokens, tok["positions"], kv, meta,
                         logits_index=row["logits_index"], attention_backend=backend)
    # logits: [R, V(/tp)]
    if replicated is not None:   # gather the vocab shards: the sampler sees whole rows
        logits = jax.lax.with_sharding_constraint(logits, replicated)   # [R, V]
    return kv, logits


def sample_step(logits: jax.Array, token_cells: jax.Array, rows: jax.Array, bias: jax.Array,
                allowed: jax.Array, draft_probs: jax.Array) -> tuple[jax.Array, SampleOutput]:
    # logits: [R, V]; rows: [len(ROW_FIELDS), R] (HostStep.packed); bias: [R, V];
    # allowed: [R, ceil(V/32)] int32 packed allowed-token mask (token_mask.py);
    # draft_probs: [R, V] the draft distribution of rows with a draft_token (else unread)
    row = unpack(rows, ROW_FIELDS)
    sampling = sampling_arrays(row, bias)
    out = verify_drafts(logits, sampling, allowed, sample(logits, sampling, allowed),
                        row["draft_token"], draft_probs)
    token_cells = token_cells.at[jnp.where(row["sample_mask"], row["row_cell"], 0)].set(
        out.tokens)
    return token_cells, out


def sampling_arrays(row: dict[str, jax.Array], bias: jax.Array) -> SamplingArrays:
    """The sampling fields of a step's rows (`unpack(rows, ROW_FIELDS)`), with their bias."""
    return SamplingArrays(row["temperature"], row["top_k"], row["top_p"], row["min_p"],
                          row["seed"], row["counter"], bias, row["logprobs"])


def unpack(packed: jax.Array, fields: tuple[Field, ...]) -> dict[str, jax.Array]:
    """A packed buffer [len(fields), N] int32 on device as its fields by name, each [N] in
    its own dtype (the inverse of HostStep.packed's rows, traced inside the step)."""
    if packed.shape[0] != len(fields):
        raise ValueError(f"a packed buffer of {packed.shape[0]} rows cannot hold the "
                         f"{len(fields)} fields {[f.name for f in fields]}")
    out = {}
    for f, x in zip(fields, packed):
        if f.dtype == np.bool_:
            out[f.name] = x != 0
        elif f.dtype == np.int32:
            out[f.name] = x
        else:
            out[f.name] = jax.lax.bitcast_convert_type(x, jnp.dtype(f.dtype))
    return out
