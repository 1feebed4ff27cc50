"""Which draft tokens a verify row keeps.

A verify row fed [t, d1 .. dk] and sampled s0 .. sk, where s_j is the target model's token
for the position after input j (drawn as without speculation: its row's sampling parameters,
its (seed, token index) uniform).  The row keeps

    d1 .. da  while s_{j-1} == d_j,  then s_a       (a + 1 tokens; a = k: s_k is the bonus)

Exactness.  Greedy: s_j is the argmax, so this is the non-speculative output.  Sampling:
an n-gram draft is a point mass q = 1{x = d_j}; standard speculative sampling accepts it with
min(1, p(d_j) / q(d_j)) = p(d_j) and otherwise draws from the residual max(0, p - q), which is
p without d_j, renormalised.  Drawing s ~ p and accepting iff s == d_j does both at once:
P(accept) = p(d_j), and a rejected s is distributed as p conditioned on s != d_j, the
residual.  So every emitted token is distributed as the target's, and with the same (seed,
token index) uniforms a seeded request even emits the same tokens as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> tuple[int, ...]:
    """The tokens a verify row emits: `sampled` [k + 1] up to and including the first one
    that differs from its draft (`drafts` [k])."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"a row verifying {len(drafts)} drafts samples {len(drafts) + 1} "
                         f"tokens, got {len(sampled)}")
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return tuple(sampled[:a + 1])
