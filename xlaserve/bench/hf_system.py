"""System (c): Hugging Face transformers `generate` on torch CPU, static left-padded batches.

    for each batch of B requests, in arrival order:
        input_ids  [B, longest prompt], left-padded, with an attention mask
        generate   greedy, max_new_tokens = min_new_tokens = the batch's longest output, so
                   every row generates that many (EOS cannot end a row early)
        per step   a stopping criterion that never stops records the time each new token
                   exists; request i completes at the step of its own m_i-th token

Only each request's first m_i tokens are its output.  KV waste is computed from the shape of
HF's cache, which holds every row at the batch's padded length: at step k it has
B * (longest prompt + k - 1) positions, of which request i owns len(prompt_i) + min(k, m_i) - 1.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from xlaserve.bench.metrics import Clock, KVWasteMeter, RequestOutcome, SystemResult
from xlaserve.bench.workload import BenchRequest, Workload


def load_hf_model(gguf: str | Path | None = None, hf_dir: str | Path | None = None) -> Any:
    """The same model in transformers, float32, eval mode: from a GGUF file (dequantized by
    transformers) or from an HF folder with safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    if (gguf is None) == (hf_dir is None):
        raise ValueError("the hf system needs exactly one of --gguf FILE or --hf-dir DIR")
    if gguf is not None:
        gguf = Path(gguf)
        if not gguf.is_file():
            raise FileNotFoundError(f"{gguf}: no such GGUF file")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    return model.eval()


def _generate(model: Any, batch: tuple[BenchRequest, ...], pad_id: int, clock: Clock,
              meter: KVWasteMeter) -> tuple[Any, list[float], int]:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    longest_prompt = max(len(r.prompt_token_ids) for r in batch)
    longest = max(r.num_output_tokens for r in batch)
    ids = torch.full((len(batch), longest_prompt), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest_prompt), dtype=torch.long)
    for i, r in enumerate(batch):
        p = len(r.prompt_token_ids)
        ids[i, longest_prompt - p:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[i, longest_prompt - p:] = 1
    times: list[float] = []

    class StepTimes(StoppingCriteria):
        """Never stops; records when each new token exists and samples the KV waste."""

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            now = clock()
            times.append(now)
            k = len(times)
            allocated = len(batch) * (longest_prompt + k - 1)
            own = sum(len(r.prompt_token_ids) + min(k, r.num_output_tokens) - 1 for r in batch)
            meter.sample(now, allocated, allocated - own)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    # EOS is an ordinary token here, as for the engine (`ignore_eos`): no EOS stops a row.
    # (`min_new_tokens` would instead forbid EOS and change the greedy text; None would fall
    # back to the model's own EOS, so the list is empty.)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []
    config.max_new_tokens, config.do_sample, config.num_beams = longest, False, 1
    config.pad_token_id = pad_id
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                             stopping_criteria=StoppingCriteriaList([StepTimes()]))
    return out[:, longest_prompt:], times, longest


def run_hf(model: Any, workload: Workload, batch_size: int, pad_id: int = 0) -> SystemResult:
    if batch_size < 1:
        raise ValueError(f"--batch {batch_size} must be >= 1")
    warm_start = time.perf_counter()
    first = workload.requests[-1]
    warm = (BenchRequest("warmup", first.prompt_token_ids[:8], 2),)
    _generate(model, warm, pad_id, Clock(), KVWasteMeter())
    warmup_s = time.perf_counter() - warm_start

    meter = KVWasteMeter()
    outcomes: dict[str, RequestOutcome] = {}
    clock = Clock()
    reqs = workload.requests
    for b0 in range(0, len(reqs), batch_size):
        batch = reqs[b0:b0 + batch_size]
        new_tokens, times, longest = _generate(model, batch, pad_id, clock, meter)
        if new_tokens.shape[1] != longest or len(times) != longest:
            raise RuntimeError(f"hf: generate returned {new_tokens.shape[1]} new tokens "
                               f"({len(times)} steps), asked for {longest}")
        for i, r in enumerate(batch):
            m = r.num_output_tokens
            outcomes[r.request_id] = RequestOutcome(
                r.request_id, tuple(int(t) for t in new_tokens[i, :m]), times[m - 1])
    wall = clock()
    meter.sample(wall, 0, 0)
    meter.finish(wall)
    import torch

    return SystemResult(f"hf(B={batch_size})", wall, outcomes, meter.waste,
                        meter.peak_allocated, None, warmup_s,
                        {"torch_threads": torch.get_num_threads()})
