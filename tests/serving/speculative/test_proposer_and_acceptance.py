"""The n-gram proposer, draft acceptance and the speculative config: host-only, exact."""

from __future__ import annotations

import pytest

from xlaserve.serving.speculative import (
    DraftProgress,
    DraftQuery,
    NgramProposer,
    SpecStats,
    SpeculativeConfig,
    accept_drafts,
)


def proposer(k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo,
                                           prompt_lookup_max=hi))


def test_proposes_what_followed_the_longest_most_recent_match() -> None:
    p = proposer()
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 4, 5, 6, 7]
    # suffix (5, 6, 7) occurred at 0: proposes 8, 9, 1; the shorter (6, 7) at 6 is not used
    assert p.propose(tokens, 10) == (8, 9, 1)
    assert p.propose(tokens, 2) == (8, 9)              # capped by max_tokens
    # suffix (3, 6, 7) never occurred, (6, 7) did: most recent at 6 -> 4, 5, 3
    assert p.propose([5, 6, 7, 8, 9, 1, 6, 7, 4, 5, 3, 6, 7], 10) == (4, 5, 3)


def test_no_match_or_too_short_proposes_nothing() -> None:
    assert proposer().propose([1, 2, 3, 4], 5) == ()
    assert proposer(lo=2).propose([1, 2, 1], 5) == ()    # (2, 1) never occurred before
    assert proposer().propose([1], 5) == ()
    assert proposer().propose([1, 2, 1], 0) == ()


def test_match_near_the_end_proposes_what_there_is() -> None:
    # (1,) last occurred at 2, followed by one token only before the suffix itself
    assert proposer(k=4, hi=1).propose([1, 9, 1, 1], 9) == (1,)
    assert proposer(k=4, hi=2).propose([7, 7, 7, 7], 9) == (7,)


def test_accept_drafts_keeps_the_agreeing_prefix_and_the_targets_token() -> None:
    assert accept_drafts((4, 5, 6), (4, 5, 6, 7)) == (4, 5, 6, 7)     # all + bonus
    assert accept_drafts((4, 5, 6), (4, 9, 6, 7)) == (4, 9)           # first rejects
    assert accept_drafts((4, 5, 6), (8, 5, 6, 7)) == (8,)
    assert accept_drafts((), (3,)) == (3,)
    with pytest.raises(ValueError, match="verifying 2 drafts samples 3 tokens, got 2"):
        accept_drafts((1, 2), (1, 2))


def test_stats_count_drafts_acceptance_and_length() -> None:
    s = SpecStats()
    s.observe(4, 4)
    s.observe(4, 0)
    s.observe(2, 1)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 10, 5)
    assert s.acceptance_counts == [1, 1, 0, 0, 1]
    assert s.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert s.acceptance_rate == pytest.approx(0.5)


def test_config_validates_and_names_bad_values() -> None:
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).num_speculative_tokens == 2
    with pytest.raises(ValueError, match="method='eagle'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min=3 > prompt_lookup_max=2"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['k'\]"):
        SpeculativeConfig.from_dict({"k": 2})


def test_draft_method_config_names_what_it_misses() -> None:
    spec = SpeculativeConfig.from_dict({"method": "draft", "draft_layers": 8,
                                        "num_speculative_tokens": 3})
    assert (spec.method, spec.draft_layers, spec.draft_model) == ("draft", 8, None)
    with pytest.raises(ValueError, match="needs draft_model .* or draft_layers"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_layers=0 must be an integer >= 1"):
        SpeculativeConfig(method="draft", draft_layers=0)
    with pytest.raises(ValueError, match="are for method='draft', not 'ngram'"):
        SpeculativeConfig(draft_layers=4)


def test_draft_progress_follows_proposals_and_verifications() -> None:
    p = DraftProgress()
    q = DraftQuery("a", (1, 2, 3, 4, 5), 0, (1, 2), limit=3)
    assert p.start("a", 4) == 0
    p.proposed(q)                         # fed 1..5, then d1, d2: positions 0..6
    assert p.computed("a") == 7
    p.check_integrity({"a": 8})           # 4 computed + t + 3 drafts reserved
    p.settle("a", 6)                      # accepted d1: the target computed 6
    assert p.computed("a") == 6 and p.start("a", 6) == 6
    with pytest.raises(AssertionError, match="draft KV through 6, holds 5"):
        p.check_integrity({"a": 5})
    p.forget("a")
    assert p.computed("a") == 0
    with pytest.raises(ValueError, match="draft start 5 outside"):
        DraftQuery("b", (1, 2, 3, 4, 5), 5, (1,), 1)
