"""A mixed serving workload for comparing engines on different layouts, and a tiny model folder.

The workload: 10 greedy requests, prompts 5..120 tokens, max_tokens 1..24, added over the first
steps (staggered), so steps mix chunked prefills (chunks of up to 32 tokens) with decode rows in
one call, and run decode-only batches of 1..4 rows.  The schedule is a pure function of the
workload and the EngineConfig (no wall clock: aging is off), so every layout sees the same
calls."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np

from xlaserve.checkpoints.store import PARAMS_DIR, save_params
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params
from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.engine.engine import LLMEngine
from xlaserve.serving.types import GenerationRequest, SamplingParams

# 9 compiled buckets per layout: decode steps of 1/2/4 rows, and steps holding prefill chunks of
# 32 or 64 tokens x rows 1/2/4, one block-table width (9 blocks = max_model_len / block_size).
# A step's token budget (64) mixes decode rows with prefill chunks; prompts over 32 tokens are
# prefilled in chunks.
ENGINE = EngineConfig.from_args(max_model_len=144, block_size=16, num_kv_blocks=64, max_num_seqs=4,
                      max_num_batched_tokens=64, max_prefill_chunk=32,
                      min_step_tokens=32, min_table_width=9, aging_seconds=math.inf)
# The two-process run: 6 buckets (decode rows 1/2, 32 or 64 tokens x rows 1/2), four requests.
MULTIHOST_ENGINE = ENGINE.with_args(max_num_seqs=2)


def workload(vocab: int, seed: int = 0, n: int = 10) -> list[tuple[int, GenerationRequest]]:
    """(engine step at which it is added, request), sorted by step."""
    rng = np.random.default_rng(seed)
    lengths = [5, 120, 17, 33, 64, 9, 100, 48, 26, 71][:n]
    out = []
    for i, length in enumerate(lengths):
        max_tokens = int(rng.integers(1, 25)) if i else 1   # request 0 ends at its first token
        max_tokens = min(max_tokens, ENGINE.scheduler.max_model_len - length)
        prompt = rng.integers(0, vocab, length).tolist()
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                  logprobs=2)
        out.append((2 * (i // 3), GenerationRequest(f"r{i}", prompt, sampling)))
    return out


def run_workload(engines: list[LLMEngine], work: list[tuple[int, GenerationRequest]],
                 ) -> list[dict[str, tuple[list[int], list[float]]]]:
    """Run the same workload on every engine in lock-step (replicas side by side).  Returns per
    engine: request id -> (generated token ids, top-1 minus top-2 logprob margins)."""
    outs: list[dict[str, tuple[list[int], list[float]]]] = [{} for _ in engines]
    step = 0
    pending = list(work)
    while pending or any(e.has_work() for e in engines):
        while pending and pending[0][0] <= step:
            _, request = pending.pop(0)
            for engine in engines:
                engine.add(GenerationRequest(request.request_id, list(request.prompt_token_ids),
                                             request.sampling))
        for engine, out in zip(engines, outs):
            for event in engine.step():
                ids, margins = out.setdefault(event.request_id, ([], []))
                ids.extend(event.token_ids)
                for lp in event.logprobs:
                    top = [p for _, p in lp.top]
                    margins.append(top[0] - top[1] if len(top) > 1 else math.inf)
                assert event.error is None, event
        step += 1
    return outs


def save_model_folder(folder: Path, params: Params, config: ModelConfig,
                      tokenizer_from: Path) -> Path:
    """A model folder as `xlaserve convert` writes it (tokenizer borrowed from another)."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save(folder / "config.json")
    save_params(folder, params)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    assert (folder / PARAMS_DIR).exists()
    return folder
