"""The prefill/decode handoff on SmolLM2 (serving/engine/kv_handoff.py): one engine runs each
prompt to its first token, its prompt KV is exported, adopted by a second engine with its own
runner and KV cache, and the request resumes there from the first token; greedy tokens equal
the unified engine's, the decode side computes only the prompt's last partial block, and both
pools keep their invariants.  Exported between the prefill's steps, slice by slice as its
chunks register blocks (the split's follow), the handoff gives the same tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.serving.engine.conftest import (
    ENGINE_CONFIG,
    collect,
    new_engine,
    prompt,
    request,
    tokens_of,
)
from xlaserve.serving.engine import LLMEngine
from xlaserve.serving.engine.kv_handoff import PrefixKV, export_prefix, import_prefix

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
LENGTHS = (17, 40, 64, 95, 128, 161, 230, 300)   # the 8-prompt parity set: 1 to 18 blocks


@pytest.fixture(scope="module")
def decode_engine(smollm2) -> LLMEngine:
    """An engine with its own runner: its own KV cache, as a decode worker has."""
    engine = LLMEngine(smollm2.params, smollm2.config, smollm2.tokenizer, smollm2.mesh,
                       ENGINE_CONFIG)
    engine.runner.warmup()
    return engine


@pytest.fixture(scope="module")
def prompts(corpus_ids) -> list[list[int]]:
    rng = np.random.default_rng(18)
    return [prompt(corpus_ids, rng, n) for n in LENGTHS]


def fresh(decode_engine: LLMEngine, smollm2) -> LLMEngine:
    """The decode engine with an empty scheduler, on its own runner (its cache's old contents
    are unreachable: no hash points at them)."""
    return new_engine(decode_engine, smollm2)


def prefill(engine: LLMEngine, prompts: list[list[int]]) -> list[int]:
    for i, p in enumerate(prompts):
        engine.add(request(f"p{i}", p, max_tokens=1))
    out = collect(engine)
    return [tokens_of(out[f"p{i}"])[0] for i in range(len(prompts))]


def test_handoff_gives_the_unified_tokens(engine, warm_engine, decode_engine, smollm2, prompts):
    for i, p in enumerate(prompts):
        engine.add(request(f"u{i}", p, max_tokens=MAX_TOKENS))
    unified = {rid: tokens_of(evs) for rid, evs in collect(engine).items()}

    prefill_side = new_engine(warm_engine, smollm2)
    firsts = prefill(prefill_side, prompts)
    decode_side = fresh(decode_engine, smollm2)
    bs = ENGINE_CONFIG.scheduler.block_size
    for p in prompts:
        kv = export_prefix(prefill_side, p, "")
        assert kv.num_blocks == len(p) // bs
        assert import_prefix(decode_side, p, "", kv) == len(p) // bs
    decode_side.scheduler.kv_cache.check_integrity()
    for i, (p, first) in enumerate(zip(prompts, firsts)):
        decode_side.add(dataclasses.replace(request(f"d{i}", p, max_tokens=MAX_TOKENS),
                                            output_token_ids=(first,)))
    finals = {}
    out = collect(decode_side)
    for i, p in enumerate(prompts):
        events = out[f"d{i}"]
        assert [firsts[i], *tokens_of(events)] == unified[f"u{i}"], i
        finals[i] = events[-1].usage
        # every full prompt block came over; only the tail and the first token ran here
        assert finals[i].cached_tokens == len(p) // bs * bs
        assert finals[i].completion_tokens == MAX_TOKENS
    prefill_side.scheduler.kv_cache.check_integrity()
    assert decode_side.scheduler.kv_cache.pool.num_used_blocks == 0


def test_partial_or_missing_handoff_recomputes(warm_engine, decode_engine, smollm2, prompts,
                                               engine):
    """Fewer blocks than the prompt has (evicted on the prefill side before the export), or
    none: the decode side computes the rest, and the tokens are the same."""
    p = prompts[-1]
    engine.add(request("u", p, max_tokens=MAX_TOKENS))
    unified = tokens_of(collect(engine)["u"])
    prefill_side = new_engine(warm_engine, smollm2)
    (first,) = prefill(prefill_side, [p])
    kv = export_prefix(prefill_side, p, "")
    for keep in (3, 0):
        decode_side = fresh(decode_engine, smollm2)
        part = PrefixKV(kv.block_size, kv.k[:, :keep], kv.v[:, :keep])
        assert import_prefix(decode_side, p, "", part) == keep
        decode_side.add(dataclasses.replace(request("d", p, max_tokens=MAX_TOKENS),
                                            output_token_ids=(first,)))
        events = collect(decode_side)["d"]
        assert [first, *tokens_of(events)] == unified
        assert events[-1].usage.cached_tokens == keep * kv.block_size


def test_slices_exported_while_the_prompt_prefills_give_the_unified_tokens(
        warm_engine, decode_engine, smollm2, prompts, engine):
    """Between the prefill's steps, export the blocks registered since the last export and
    import each slice on the decode side: the first slices come before the first token, the
    last once the request finished, and the resumed request matches the unified engine."""
    p = prompts[-1]                                    # 300 tokens: chunks of 256 and 44
    engine.add(request("u", p, max_tokens=MAX_TOKENS))
    unified = tokens_of(collect(engine)["u"])
    prefill_side = new_engine(warm_engine, smollm2)
    decode_side = fresh(decode_engine, smollm2)
    prefill_side.add(request("p", p, max_tokens=1))
    sent, slices, first = 0, [], None
    while prefill_side.has_work() or first is None:
        for ev in prefill_side.step():
            first = ev.token_ids[0] if ev.token_ids else first
        kv = export_prefix(prefill_side, p, "", sent)
        assert kv.first_block == sent
        if kv.num_blocks:
            assert import_prefix(decode_side, p, "", kv) == kv.num_blocks
            slices.append((kv.num_blocks, first is not None))
            sent += kv.num_blocks
    assert sent == len(p) // 16 and slices[0] == (16, False), slices   # the first chunk's
    prefill_side.scheduler.kv_cache.check_integrity()
    decode_side.add(dataclasses.replace(request("d", p, max_tokens=MAX_TOKENS),
                                        output_token_ids=(first,)))
    events = collect(decode_side)["d"]
    assert [first, *tokens_of(events)] == unified
    assert events[-1].usage.cached_tokens == sent * 16
    # a slice whose earlier blocks are not cached on the importing side is not taken
    other = fresh(decode_engine, smollm2)
    later = export_prefix(prefill_side, p, "", 4)
    assert (later.first_block, later.num_blocks) == (4, sent - 4)
    assert import_prefix(other, p, "", later) == 0
    assert other.scheduler.kv_cache.pool.num_used_blocks == 0
    other.scheduler.kv_cache.check_integrity()


def test_other_tenant_never_hits_the_handed_over_blocks(warm_engine, decode_engine, smollm2,
                                                        prompts):
    p = prompts[3]
    prefill_side = new_engine(warm_engine, smollm2)
    (first,) = prefill(prefill_side, [p])
    assert export_prefix(prefill_side, p, "tenant-b").num_blocks == 0   # salted by tenant
    decode_side = fresh(decode_engine, smollm2)
    import_prefix(decode_side, p, "", export_prefix(prefill_side, p, ""))
    req = dataclasses.replace(request("d", p, max_tokens=2), output_token_ids=(first,),
                              tenant="tenant-b")
    decode_side.add(req)
    assert collect(decode_side)["d"][-1].usage.cached_tokens == 0


def test_bad_handoffs_are_refused(decode_engine, smollm2, prompts):
    decode_side = fresh(decode_engine, smollm2)
    p = prompts[0]
    k = np.zeros((smollm2.config.num_layers, 2, 16, smollm2.config.num_kv_heads,
                  smollm2.config.head_dim), np.float32)
    with pytest.raises(ValueError, match=r"blocks \[0, 2\) of 16 tokens for a prompt of 17"):
        import_prefix(decode_side, p, "", PrefixKV(16, k, k))
    with pytest.raises(ValueError, match="block_size 32"):
        import_prefix(decode_side, p, "", PrefixKV(32, k[:, :0], k[:, :0]))
    with pytest.raises(ValueError, match="output_token_ids end it already"):
        decode_side.add(dataclasses.replace(request("eos", p, max_tokens=4),
                                            output_token_ids=(smollm2.config.eos_token_ids[0],)))
    with pytest.raises(ValueError, match="leave no room"):
        decode_side.add(dataclasses.replace(request("full", p, max_tokens=1),
                                            output_token_ids=(5,)))
    decode_side.scheduler.check_integrity()
