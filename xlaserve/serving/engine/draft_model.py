"""The draft model of method "draft": its parameters, its config and its runner.

    draft_model = "/models/small"   that checkpoint (same vocabulary: same tokenizer), placed
                                    on the served model's mesh
    draft_layers = N                the first N layers of it (of the served model itself
                                    when no draft_model is given), under its own final norm
                                    and output head: a truncated layer stack

The runner is a DraftRunner with its own paged KV cache of the engine's block count and
block size (its slots are the target's: speculative/draft_progress.py), and a bucket plan for
what the proposer feeds: one token per row, or catch-up chunks up to max_prefill_chunk.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params
from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.runner.buckets import BucketPlan
from xlaserve.serving.runner.draft_runner import DraftRunner
from xlaserve.serving.speculative import SpeculativeConfig


def truncated(params: Params, config: ModelConfig, num_layers: int
              ) -> tuple[Params, ModelConfig]:
    """The first `num_layers` of a model's stacked layers, with its embedding, norm, head."""
    if num_layers > config.num_layers:
        raise ValueError(f"draft_layers={num_layers} exceeds the model's {config.num_layers} "
                         f"layers")
    if "head" in params:
        raise ValueError("truncated: these parameters are packed for the CPU kernels "
                         "(pack_params); pass the model's own")
    layers = jax.tree_util.tree_map(lambda a: a[:num_layers], params["layers"])
    return {**params, "layers": layers}, config.first_layers(num_layers)


def draft_params(spec: SpeculativeConfig, params: Params, config: ModelConfig, mesh: Mesh
                 ) -> tuple[Params, ModelConfig]:
    """The draft's parameters and config for the target (`params`, `config`) on `mesh`."""
    if spec.draft_model is not None:
        draft_config = load_config(spec.draft_model, config.dtype)
        if draft_config.vocab_size != config.vocab_size:
            raise ValueError(f"draft_model={spec.draft_model!r} has a vocabulary of "
                             f"{draft_config.vocab_size}, the served model "
                             f"{config.vocab_size}: a draft needs the same tokenizer")
        params, config = load_params(spec.draft_model, draft_config, mesh), draft_config
    if spec.draft_layers is not None:
        params, config = truncated(params, config, spec.draft_layers)
    return params, config


def draft_bucket_plan(engine_config: EngineConfig) -> BucketPlan:
    """Rows up to max_num_seqs; tokens up to a catch-up chunk (max_prefill_chunk) or every
    row's first proposal call (1 + k tokens a row), whichever is more."""
    s, spec = engine_config.scheduler, engine_config.speculative
    assert spec is not None
    return engine_config.buckets_for(
        max(s.max_prefill_chunk, s.max_num_seqs * (1 + spec.num_speculative_tokens)))


def make_draft_runner(params: Params, config: ModelConfig, mesh: Mesh,
                      engine_config: EngineConfig) -> DraftRunner:
    """The draft runner for the target (`params`, `config`) under `engine_config`."""
    spec = engine_config.speculative
    if spec is None or spec.method != "draft":
        raise ValueError(f"a draft runner is for method 'draft', got speculative={spec!r}")
    d_params, d_config = draft_params(spec, params, config, mesh)
    runner = DraftRunner(d_params, d_config, mesh,
                         **engine_config.runner_args(draft_bucket_plan(engine_config)))
    if not runner.is_leader or runner.channel is not None:
        raise ValueError("method 'draft' runs on one process (a multi-host mesh would need "
                         "its followers to follow the draft runner too)")
    return runner
