"""Draft-model speculation keeps the target's distribution with a real draft distribution q:
a tiny 2-layer target whose own first layer (under its norm and head) is the draft, so q is
neither p nor a point mass.  Sampled thousands of times through verify rows (accept with
min(1, p/q), else the residual), the joint of three generated tokens matches the target's
exact one (chi-square); greedy drafts give the non-speculative tokens exactly."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2

from tests.serving.engine.test_speculative_distribution import BS, V, chi_square, exact_joint
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import init_params
from xlaserve.serving.engine import EngineConfig, LLMEngine
from xlaserve.serving.speculative import SpeculativeConfig
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import GenerationRequest, SamplingParams
from xlaserve.sharding.mesh import make_mesh

TARGET = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=16, eos_token_ids=(2,))
TEMPERATURE = 1.5
N = 3000
ARGS = dict(max_model_len=48, block_size=BS, num_kv_blocks=160, max_num_seqs=16,
            max_num_batched_tokens=64, max_prefill_chunk=64, min_step_tokens=32,
            min_table_width=12)


@pytest.fixture(scope="module")
def tiny(model_dir):
    params = init_params(TARGET, 11, scale=1.0)
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=2, draft_layers=1)
    engine = LLMEngine(params, TARGET, Tokenizer.load(model_dir), make_mesh(),
                       EngineConfig.from_args(ARGS, speculative=spec))
    engine.runner.warmup()
    assert engine.draft is not None
    engine.draft.runner.warmup()
    return params, engine


def run_all(engine: LLMEngine, requests: list[GenerationRequest], at_once: int
            ) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    todo = requests[::-1]
    while todo or engine.has_work():
        while todo and engine.scheduler.num_running + engine.scheduler.num_waiting < at_once:
            engine.add(todo.pop())
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache.usage().num_used_blocks == 0
    return out


def test_greedy_drafts_give_the_target_tokens(tiny, model_dir) -> None:
    params, engine = tiny
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, V, n)] for n in (5, 9, 17, 30)]
    reqs = [GenerationRequest(f"g{i}", p, SamplingParams(max_tokens=14, temperature=0.0,
                                                         ignore_eos=True))
            for i, p in enumerate(prompts)]
    plain = LLMEngine(params, TARGET, Tokenizer.load(model_dir), make_mesh(),
                      EngineConfig.from_args(ARGS))
    plain.runner.warmup()
    drafts_before = engine.scheduler.spec_stats.num_draft_tokens
    assert run_all(engine, reqs, 4) == run_all(plain, reqs, 4)
    assert engine.scheduler.spec_stats.num_draft_tokens > drafts_before


def test_sampled_tokens_follow_the_target_distribution(tiny) -> None:
    params, engine = tiny
    prompt = [int(t) for t in np.random.default_rng(0).permutation(V)]
    before = engine.scheduler.spec_stats.snapshot()
    out = run_all(engine, [GenerationRequest(f"r{i}", list(prompt), SamplingParams(
        max_tokens=3, temperature=TEMPERATURE, seed=i, ignore_eos=True)) for i in range(N)], 5)
    counts = np.zeros((V, V, V))
    for tokens in out.values():
        assert len(tokens) == 3
        counts[tuple(tokens)] += 1
    stats = engine.scheduler.spec_stats
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    # every x2 came through a verify row; a real q: drafts both kept and rejected
    assert stats.num_drafts - before.num_drafts >= N, stats
    assert 0.1 * drafted < accepted < 0.9 * drafted, (accepted, drafted)

    target = exact_joint(params, prompt, TEMPERATURE, TARGET)
    draft_params = {**params, "layers": {k: v[:1] for k, v in params["layers"].items()}}
    draft = exact_joint(draft_params, prompt, TEMPERATURE, TARGET.replace(num_layers=1))
    observed = counts.ravel()
    stat, dof = chi_square(observed, N * target.ravel())
    assert dof >= 20, f"only {dof + 1} cells: the test would have little power"
    assert chi2.sf(stat, dof) > 1e-3, (stat, dof)
    # the power to see a wrong distribution: the draft's own (its first layer alone)
    stat, dof = chi_square(observed, N * draft.ravel())
    assert chi2.sf(stat, dof) < 1e-6, (stat, dof)

    # Each request verified one draft, x2 ~ q(. | x1): accepted with min(1, p/q), the rate is
    # E[1 - TV(p, q)] over x1 ~ p, above the E[p(d)] of accepting iff a draw from p equals d
    p1 = target.sum(axis=(1, 2))                                     # P(x1)
    p2 = target.sum(axis=2) / p1[:, None]                            # p(x2 | x1)
    q2 = draft.sum(axis=2) / draft.sum(axis=(1, 2))[:, None]         # q(x2 | x1)
    optimal = float((p1 * np.minimum(p2, q2).sum(axis=1)).sum())
    point_mass = float((p1 * (p2 * q2).sum(axis=1)).sum())
    rate = accepted / drafted
    assert drafted == N and abs(rate - optimal) < 0.04, (rate, optimal, point_mass)
    assert optimal - point_mass > 0.08, (optimal, point_mass)
