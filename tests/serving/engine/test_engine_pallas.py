"""The engine on the Pallas attention kernels (interpret mode on CPU): staggered mixed requests
produce what the model computes for each request alone.

Interpret mode runs each kernel program through XLA ops, so this uses a smaller engine and
workload than test_batch_invariance (which runs the same checks on 48 requests with the
reference attention)."""

from __future__ import annotations

import numpy as np

from tests.serving.engine.conftest import prompt
from tests.serving.engine.test_batch_invariance import check_teacher_forced, run_staggered
from xlaserve.serving.engine import EngineConfig, LLMEngine
from xlaserve.serving.runner.compile_counter import CompileCounter

PALLAS_CONFIG = EngineConfig(max_model_len=256, num_kv_blocks=128, max_num_seqs=4,
                             max_num_batched_tokens=128, max_prefill_chunk=64,
                             max_prefill_tokens=64, max_prefill_rows=2, min_table_width=4,
                             attention_backend="pallas")


def test_pallas_engine_outputs_equal_requests_run_alone(smollm2, corpus_ids) -> None:
    engine = LLMEngine(smollm2.params, smollm2.config, smollm2.tokenizer, smollm2.mesh,
                       PALLAS_CONFIG)
    engine.runner.warmup()
    rng = np.random.default_rng(6)
    lengths = [5, 200, 17, 64, 33, 120, 9, 48]
    max_tokens = [40, 1, 12, 5, 24, 3, 30, 8]
    work = [(prompt(corpus_ids, rng, n), m) for n, m in zip(lengths, max_tokens)]
    with CompileCounter() as compiles:
        outputs = run_staggered(engine, work)
    assert compiles.count == 0
    check_teacher_forced(smollm2, work, outputs)
