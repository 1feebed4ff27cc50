"""The transformers baseline decodes exactly what greedy argmax gives, EOS included: the
workload ignores EOS (it is an ordinary token), so generate must neither stop at it nor
forbid it."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from xlaserve.bench.hf_system import _generate
from xlaserve.bench.metrics import Clock, KVWasteMeter
from xlaserve.bench.workload import BenchRequest

EOS = 2


def test_generate_treats_eos_as_an_ordinary_token() -> None:
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                      eos_token_id=EOS, initializer_range=0.5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    req = BenchRequest("r0", (3, 4, 5, 6, 7, 3), 12)
    new, times, longest = _generate(model, (req,), pad_id=0, clock=Clock(),
                                    meter=KVWasteMeter())

    ids = torch.tensor([req.prompt_token_ids])
    with torch.inference_mode():
        for _ in range(12):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], 1)
    greedy = ids[0, len(req.prompt_token_ids):].tolist()
    assert EOS in greedy[:-1]           # the case that matters: EOS mid-sequence
    assert new[0].tolist() == greedy
    assert longest == 12 and len(times) == 12
