"""The prefill pick of the split (serving/disagg/affinity.py), with exact choices: a prompt
goes where its longest prefix was prefilled unless that worker is busier than the least
loaded by more than the slack; unrelated prompts take the least loaded in turn; the memory
stays within its capacity."""

from __future__ import annotations

import pytest

from xlaserve.serving.disagg.affinity import PrefixAffinity

BS = 4


def prompt(prefix: int, n: int, tail: int = 0) -> list[int]:
    """n tokens: a run shared by every prompt of the same `prefix`, then `tail` others."""
    return [prefix * 1000 + i for i in range(n - tail)] + [900_000 + t for t in range(tail)]


def test_a_repeated_prefix_goes_back_to_its_worker_and_others_spread():
    a = PrefixAffinity(BS, slack=1)
    workers = ["A", "B"]
    h = a.hashes(prompt(1, 40), "")
    first = a.choose(workers, [0, 0], h)
    a.record(first, h)
    for tail in (1, 5, 9):   # the same 7-8 leading blocks of 10, another end
        again = a.hashes(prompt(1, 40, tail), "")
        assert a.match(again) == (first, len(again) - (tail + BS - 1) // BS), tail
        assert a.choose(workers, [0, 0], again) == first
    spread = []
    for p in (2, 3, 4, 5):   # unrelated prompts: in turn
        hp = a.hashes(prompt(p, 40), "")
        spread.append(a.choose(workers, [0, 0], hp))
        a.record(spread[-1], hp)
    assert sorted(spread) == ["A", "A", "B", "B"], spread


def test_load_overrides_the_prefix_past_the_slack_and_a_short_match_does_not_count():
    a = PrefixAffinity(BS, slack=2)
    h = a.hashes(prompt(1, 40), "")
    a.record("A", h)
    assert a.choose(["A", "B"], [2, 0], h) == "A"       # within the slack
    assert a.choose(["A", "B"], [3, 0], h) == "B"       # too busy: the least loaded
    assert a.choose(["B"], [5], h) == "B"               # A not live
    # 4 of 10 blocks shared: under MIN_MATCH, plain load (B, the least loaded)
    short = a.hashes(prompt(1, 16) + prompt(9, 24), "")
    assert a.match(short) == ("A", 4)
    assert a.choose(["A", "B"], [1, 0], short) == "B"
    # another tenant's hashes are other hashes
    assert a.match(a.hashes(prompt(1, 40), "tenant-2")) == (None, 0)


def test_memory_is_bounded_oldest_first():
    a = PrefixAffinity(BS, capacity=12)
    old, new = a.hashes(prompt(1, 40), ""), a.hashes(prompt(2, 40), "")
    a.record("A", old)
    a.record("B", new)
    assert len(a) == 12
    assert a.match(new) == ("B", 10)
    # old's first 8 hashes went first; its last ones still name the whole chain
    assert a.match(old) == ("A", 10) and a.match(old[:8]) == (None, 0)
    a.record("B", a.hashes(prompt(3, 40), ""))
    assert len(a) == 12 and a.match(old) == (None, 0)
    with pytest.raises(ValueError, match="2 workers with 1 loads"):
        a.choose(["A", "B"], [0], new)
