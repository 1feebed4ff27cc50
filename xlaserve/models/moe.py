"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): route, dispatch, run the
experts, combine.  It stands in for the dense SwiGLU MLP of every decoder layer (models/llama.py).

    h [T, E] -> router logits  h @ router                                        [T, X] float32
             -> gates          softmax over all X experts, the top k kept (k = num_experts_per_tok),
                               renormalised to sum 1 with norm_topk_prob (Mixtral always: the same
                               as a softmax over the top-k logits)                [T, k], ids [T, k]
             -> dispatch       the T*k (token, expert) pairs sorted by expert, stably: group g is
                               the run of pairs routed to expert g           [T*k, E], sizes [X]
             -> experts        SwiGLU per group over the sorted rows (kernels/grouped_swiglu.py:
                               tiles of one expert each; jax.lax.ragged_dot is its reference): no
                               capacity, no token dropped
             -> combine        each pair's output back at its token, times its gate, summed over
                               the token's k experts in slot order                [T, E]
             (+ Qwen2-MoE's shared expert: a dense SwiGLU of every token, times sigmoid(h @ gate))

Dropless, so batch invariant: a token's output is its own k experts' outputs and nothing else;
what else is in the batch only changes how many rows each group has.  Padding tokens are routed
like any other and their outputs never read.

Expert parallelism (sharding/parallel_forward.py): the expert weights are stacked on the
`experts` axis, [L, X, E, F], and a shard holds experts [first, first + X_local).  Every shard
sees every token (the flat batch is replicated), routes all of them the same way, sorts the pairs
routed elsewhere past its own groups (the grouped SwiGLU leaves rows past the groups' total at
zero, and the combine masks them anyway) and returns the partial sum over its experts;
ExpertShard.reduce adds the partials over the expert (and tensor) shards.  The shared expert is
added by the shards of expert rank 0 only, so the sum counts it once.

Einsum letters: T tokens, k experts per token, E embed, X experts (X_local on a shard),
F expert hidden (F / tp on a tensor shard), S shared-expert hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from xlaserve.kernels.grouped_swiglu import grouped_swiglu
from xlaserve.models.config import ModelConfig

Params = dict[str, Any]


class ExpertShard(NamedTuple):
    """Which experts this device runs and how partial MoE outputs are added up.

    One device: every expert, the shared one too, and nothing to add (reduce None)."""

    first: jax.Array | int       # global id of this shard's first expert
    adds_shared: jax.Array | bool  # does this shard add the shared expert's output
    reduce: Callable[[jax.Array], jax.Array] | None   # sum over expert and tensor shards


ONE_DEVICE = ExpertShard(0, True, None)


def moe_param_axes(config: ModelConfig) -> Params:
    """Logical axes of one stacked MoE MLP (the router's expert axis stays whole: every shard
    routes every token)."""
    axes: Params = {
        "router": ("layers", "embed", None),                       # [L, E, X]
        "we_gate": ("layers", "experts", "embed", "mlp"),          # [L, X, E, F]
        "we_up": ("layers", "experts", "embed", "mlp"),            # [L, X, E, F]
        "we_down": ("layers", "experts", "mlp", "embed"),          # [L, X, F, E]
    }
    if config.shared_expert_intermediate_size:
        axes.update({
            "ws_gate": ("layers", "embed", "mlp"),                 # [L, E, S]
            "ws_up": ("layers", "embed", "mlp"),                   # [L, E, S]
            "ws_down": ("layers", "mlp", "embed"),                 # [L, S, E]
            "ws_router": ("layers", "embed"),                      # [L, E]
        })
    return axes


def moe_param_shapes(config: ModelConfig) -> Params:
    c = config
    L, E, X, F = c.num_layers, c.hidden_size, c.num_experts, c.moe_intermediate_size
    shapes: Params = {"router": (L, E, X), "we_gate": (L, X, E, F), "we_up": (L, X, E, F),
                      "we_down": (L, X, F, E)}
    if c.shared_expert_intermediate_size:
        S = c.shared_expert_intermediate_size
        shapes.update({"ws_gate": (L, E, S), "ws_up": (L, E, S), "ws_down": (L, S, E),
                       "ws_router": (L, E)})
    return shapes


def route(config: ModelConfig,
          h: jax.Array,        # [T, E]
          router: jax.Array,   # [E, X]
          ) -> tuple[jax.Array, jax.Array]:   # gates [T, k] float32, expert ids [T, k] int32
    logits = jnp.einsum("te,ex->tx", h, router,
                        preferred_element_type=jnp.float32)          # [T, X]
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, config.num_experts_per_tok)   # ties: lower id first
    if config.norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return gates, experts.astype(jnp.int32)


def routed_experts(h: jax.Array,        # [T, E]
                   gates: jax.Array,    # [T, k] float32
                   experts: jax.Array,  # [T, k] int32 global expert ids
                   w_gate: jax.Array,   # [L, X_local, E, F] every layer's (read at `layer`)
                   w_up: jax.Array,     # [L, X_local, E, F]
                   w_down: jax.Array,   # [L, X_local, F, E]
                   layer: jax.Array | int,
                   first: jax.Array | int = 0,
                   ) -> jax.Array:      # [T, E]: the sum over this shard's experts
    """Sort the (token, expert) pairs by expert, run every local expert on its run of rows with
    one grouped matmul per weight, and put the gated outputs back at their tokens."""
    t, k = experts.shape
    count = w_gate.shape[1]
    local = experts.reshape(-1) - first                               # [T*k]
    mine = (local >= 0) & (local < count)
    group = jnp.where(mine, local, count)                             # others: a last group
    order = jnp.argsort(group, stable=True)                           # [T*k] pair of each row
    sizes = jnp.bincount(group, length=count + 1)[:count].astype(jnp.int32)   # [X_local]
    rows = h[order // k]                                              # [T*k, E]
    out = grouped_swiglu(rows, w_gate, w_up, w_down, sizes, layer)    # [T*k, E]
    pairs = t * k
    slot = jnp.zeros((pairs,), jnp.int32).at[order].set(jnp.arange(pairs, dtype=jnp.int32))
    out = jnp.where(mine[:, None], out[slot], 0).reshape(t, k, -1)    # [T, k, E] pair order
    return jnp.einsum("tk,tke->te", gates.astype(h.dtype), out)


def shared_expert(h: jax.Array,          # [T, E]
                  w_gate: jax.Array,     # [E, S]
                  w_up: jax.Array,       # [E, S]
                  w_down: jax.Array,     # [S, E]
                  w_router: jax.Array,   # [E]
                  ) -> jax.Array:        # [T, E] (a partial sum when S is a tensor shard)
    gate = jax.nn.sigmoid(jnp.einsum("te,e->t", h, w_router))[:, None]   # [T, 1]
    act = jax.nn.silu(h @ w_gate) * (h @ w_up)                           # [T, S]
    return (act @ w_down) * gate


def moe_mlp(config: ModelConfig, layers: Params, i: jax.Array, h: jax.Array,
            shard: ExpertShard = ONE_DEVICE) -> jax.Array:   # h [T, E] -> [T, E]
    """Layer `i`'s MoE MLP of the normed hidden states h, summed over the shards."""
    gates, experts = route(config, h, layers["router"][i])
    y = routed_experts(h, gates, experts, layers["we_gate"], layers["we_up"],
                       layers["we_down"], i, shard.first)
    if config.shared_expert_intermediate_size:
        s = shared_expert(h, layers["ws_gate"][i], layers["ws_up"][i], layers["ws_down"][i],
                          layers["ws_router"][i])
        y = y + (s if shard.adds_shared is True else jnp.where(shard.adds_shared, s, 0))
    return y if shard.reduce is None else shard.reduce(y)
