"""Speculative sampling follows the target distribution: a tiny model with 24 tokens, whose
exact distribution over three generated tokens is computed from its teacher-forced logits,
sampled thousands of times through verify rows; a chi-square test over the joint."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from xlaserve.models.batch_metadata import one_row_metadata
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import (
    AttentionMetadata,
    forward,
    init_kv_cache,
    init_params,
)
from xlaserve.serving.engine import EngineConfig, LLMEngine
from xlaserve.serving.speculative import SpeculativeConfig
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import GenerationRequest, SamplingParams
from xlaserve.sharding.mesh import make_mesh

V = 24          # >= the 20 top logprobs the sampler is compiled for
CONFIG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, eos_token_ids=(2,))
BS = 4
TEMPERATURE = 2.5
N = 4000


def exact_joint(params, prompt: list[int], temperature: float,
                config: ModelConfig = CONFIG) -> np.ndarray:
    """P(x1, x2, x3 | prompt) [V, V, V] at `temperature`, from the teacher-forced logits of
    every prompt + (x1, x2) (the jnp reference attention, one compiled length)."""
    n = len(prompt) + 2
    width = -(-n // BS)
    positions, meta = one_row_metadata(np.arange(1, width + 1, dtype=np.int32), 0, n, n, BS)
    meta = AttentionMetadata(*(jnp.asarray(a) for a in meta))

    @jax.jit
    def log_probs(params, tokens: jax.Array) -> jax.Array:     # [n] -> [n, V]
        kv = init_kv_cache(config, width + 1, BS)
        logits, _ = forward(params, config, tokens, jnp.asarray(positions), kv, meta,
                            attention_backend="reference")
        return jax.nn.log_softmax(logits / temperature, axis=-1)

    p = len(prompt)
    joint = np.zeros((V, V, V))
    for x1, x2 in itertools.product(range(V), range(V)):
        lp = np.asarray(log_probs(params, jnp.asarray(prompt + [x1, x2], jnp.int32)),
                        np.float64)
        joint[x1, x2] = np.exp(lp[p - 1, x1] + lp[p, x2] + lp[p + 1])
    return joint


@pytest.fixture(scope="module")
def tiny(model_dir):
    params = init_params(CONFIG, 7, scale=1.0)
    config = EngineConfig.from_args(
        max_model_len=48, block_size=BS, num_kv_blocks=160, max_num_seqs=16,
        max_num_batched_tokens=64, max_prefill_chunk=64, min_step_tokens=32, min_table_width=12,
        speculative=SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1,
                                      prompt_lookup_max=1))
    engine = LLMEngine(params, CONFIG, Tokenizer.load(model_dir), make_mesh(), config)
    engine.runner.warmup()
    return params, engine


def greedy_prompt(engine: LLMEngine) -> list[int]:
    """Every token once, then the model's own greedy continuation: its chain settles into a
    loop, so the last token's previous occurrence proposes what the model tends to say next
    (drafts accepted often, and rejected often enough at TEMPERATURE)."""
    base = [int(t) for t in np.random.default_rng(0).permutation(V)]
    engine.add(GenerationRequest("greedy", base, SamplingParams(max_tokens=10, temperature=0.0,
                                                                 ignore_eos=True)))
    return base + [t for ev in engine.run_until_done() for t in ev.token_ids]


def test_sampled_tokens_follow_the_target_distribution(tiny) -> None:
    params, engine = tiny
    prompt = greedy_prompt(engine)
    counts = np.zeros((V, V, V))
    out: dict[str, list[int]] = {}
    todo = list(range(N))[::-1]
    while todo or engine.has_work():
        # at most 5 requests at once: decode rows leave sample rows spare for drafts
        while todo and engine.scheduler.num_running + engine.scheduler.num_waiting < 5:
            i = todo.pop()
            engine.add(GenerationRequest(f"r{i}", list(prompt), SamplingParams(
                max_tokens=3, temperature=TEMPERATURE, seed=i, ignore_eos=True)))
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        engine.scheduler.check_integrity()
    for tokens in out.values():
        assert len(tokens) == 3
        counts[tuple(tokens)] += 1
    stats = engine.scheduler.spec_stats
    # x2 (and x3 when x2 was the draft) went through a verify row; drafts kept and rejected
    assert stats.num_drafts >= 0.9 * N, stats
    assert 0.1 * stats.num_draft_tokens < stats.num_accepted_tokens, stats
    assert stats.num_accepted_tokens < 0.9 * stats.num_draft_tokens, stats

    observed = counts.ravel()
    stat, dof = chi_square(observed, N * exact_joint(params, prompt, TEMPERATURE).ravel())
    assert dof >= 20, f"only {dof + 1} cells: the test would have little power"
    assert chi2.sf(stat, dof) > 1e-3, (stat, dof)
    # and it has the power to see a wrong distribution: the same draws against temperature 2
    stat, dof = chi_square(observed, N * exact_joint(params, prompt, 2.0).ravel())
    assert chi2.sf(stat, dof) < 1e-6, (stat, dof)


def chi_square(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, cells expecting < 5 pooled into one."""
    big = expected >= 5
    exp_cells = np.append(expected[big], expected[~big].sum())
    obs_cells = np.append(observed[big], observed[~big].sum())
    return float(((obs_cells - exp_cells) ** 2 / exp_cells).sum()), len(exp_cells) - 1
