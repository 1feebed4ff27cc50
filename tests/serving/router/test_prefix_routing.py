"""Replica choice by what each replica was sent: block chains, the shared-prefix cut, a
conversation's next turn, tenants, overload and the index's bound (no jax, no server)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from xlaserve.serving.admission import AdmissionController
from xlaserve.serving.engine_api import EngineStats
from xlaserve.serving.router import ModelGroup, Replica
from xlaserve.serving.router.prefix_index import PrefixIndex, block_chain
from xlaserve.serving.server_config import AdmissionConfig, RouterConfig, ServedModel

SYSTEM = list(range(1000, 1024))           # 24 tokens: one full block of 16 and a part


@dataclass
class Idle:
    """Just enough of an engine for routing: ready, nothing waiting."""

    ready: bool = True

    def stats(self) -> EngineStats:
        return EngineStats()


def group(n: int = 2, **router) -> ModelGroup:
    reps = [Replica(f"r{i}", Idle()) for i in range(n)]
    adm = AdmissionController(AdmissionConfig(), 4, 4)
    return ModelGroup(ServedModel("m"), reps, adm, RouterConfig(**router))


def route(g: ModelGroup, ids: list[int], tenant: str = "t") -> Replica:
    r = g.pick(ids, tenant)
    r.routed += 1
    return r


def test_block_chain_hashes_whole_prefixes_per_tenant():
    a = block_chain(list(range(40)), "t", 16, 64)
    assert len(a) == 2                                      # 40 tokens: two full blocks
    assert block_chain(list(range(40)), "t", 16, 1) == a[:1]
    assert block_chain(list(range(35)) + [7] * 5, "t", 16, 64) == a   # the tail is not hashed
    assert block_chain(list(range(40)), "u", 16, 64) != a   # another tenant, another chain
    b = block_chain([99] + list(range(1, 40)), "t", 16, 64)
    assert b[0] != a[0] and b[1] != a[1]                    # a block hash names its prefix


def test_index_matches_leading_blocks_counts_and_forgets_the_oldest():
    idx = PrefixIndex(capacity=3)
    idx.add([1, 2])
    idx.add([1, 3])
    assert idx.matched([1, 2, 9]) == 2 and idx.matched([9, 1]) == 0
    assert idx.shared([1, 2], at_least=2) == 1               # 1 was added twice, 2 once
    idx.add([4])                                             # 4 entries > 3: 2 goes
    assert len(idx) == 3 and idx.matched([1, 2]) == 1
    with pytest.raises(ValueError, match="capacity=0"):
        PrefixIndex(0)


def test_next_turns_follow_their_conversation_and_new_ones_spread():
    g = group(shared_after=4)
    convs = [SYSTEM + [i] * 12 for i in range(8)]            # 36 tokens: 2 full blocks
    first = [route(g, c) for c in convs]
    assert {r.name for r in first} == {"r0", "r1"}           # spread once SYSTEM is common
    for c, r in zip(convs, first):
        g.remember(r, c + [7] * 6, "t")                      # its answer
        # the next turn: the same prefix, the answer, a new question (longer than before)
        assert route(g, c + [7] * 6 + [5] * 20) is r
    # another tenant's identical conversation is not tied to where the first one went
    assert g.blocks.shared(block_chain(convs[0], "u", 16, 64), 1) == 0


def test_prompts_sharing_only_a_common_prefix_go_by_load():
    g = group(shared_after=2)
    for i in range(2):                                       # SYSTEM is common after two
        route(g, SYSTEM + [i] * 12)
    g.replicas[0].inflight = 3
    assert route(g, SYSTEM + [50] * 12).name == "r1"         # matches r0 only on SYSTEM


def test_an_overloaded_holder_loses_the_conversation():
    g = group(overload_slack=2)
    conv = SYSTEM + [3] * 40
    holder = route(g, conv)
    holder.inflight = 1
    assert route(g, conv + [4] * 16) is holder               # 1 more than the other: stays
    holder.inflight = 2                                      # 2 more: the turn spills over
    other = route(g, conv + [4] * 32)
    assert other is not holder
    holder.inflight = 0
    assert route(g, conv + [4] * 48) is other                # and lives there now


def test_short_prompts_and_one_replica_go_by_load():
    g = group()
    g.replicas[0].inflight = 1
    assert route(g, [1, 2, 3]).name == "r1"                  # no full block
    one = group(1)
    assert route(one, SYSTEM * 4).name == "r0"
