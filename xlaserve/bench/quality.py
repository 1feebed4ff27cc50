"""`xlaserve bench quality`: a quantized model against its float32 original, measured.

    corpus (bench/data/quality_corpus.txt, shipped: prose, dialogue, a recipe, code)
      -> windows of --window tokens, each from an empty cache
      -> both models' logits at every position, teacher-forced on the corpus' next tokens
      -> perplexity of each, top-1 agreement of their next-token argmax, max and mean
         |logit difference|
    chat prompts (bench/quality.py CHAT_PROMPTS) -> greedy --max-tokens from each model
      -> prompts answered identically, mean tokens before the first difference

Both models run the same forward (models.llama.forward, the CPU kernels where they serve),
one window at a time, so the figures differ only by the quantization.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.bench.report import write_json
from xlaserve.models.batch_metadata import one_row_metadata
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import (
    KVCache,
    Params,
    forward,
    init_kv_cache,
    pack_params,
)
from xlaserve.serving.loading import LoadedModel, load_model

CORPUS = Path(__file__).parent / "data" / "quality_corpus.txt"

CHAT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Write a Python function that reverses a string.",
    "Summarise the plot of Little Red Riding Hood in two sentences.",
    "What is the difference between weather and climate?",
)


@dataclass(frozen=True)
class QualityReport:
    model: str
    quantization: str            # what is compared with float32, e.g. "int8 weights + int8 KV"
    tokens: int                  # teacher-forced next tokens scored
    ppl_float: float
    ppl_quantized: float
    ppl_change: float            # ppl_quantized / ppl_float - 1
    top1_agreement: float        # share of positions whose argmax agrees
    max_logit_error: float       # max |logit_q - logit_f| over every position and token
    mean_logit_error: float
    greedy_identical: int        # chat prompts answered token for token the same
    greedy_prompts: int
    greedy_mean_prefix: float    # mean tokens generated before the first difference
    greedy_tokens: int           # tokens asked of each answer


@partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("kv",))
def _window_logits(params: Params, config: ModelConfig, tokens: jax.Array,
                   positions: jax.Array, kv: KVCache, meta, backend: str
                   ) -> tuple[jax.Array, KVCache]:
    return forward(params, config, tokens, positions, kv, meta, attention_backend=backend)


def _windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window + 1] for i in range(0, len(ids) - 1, window)
            if len(ids[i:i + window + 1]) > 1]


def _runnable(model: LoadedModel, backend: str) -> Params:
    """The parameters as the runner serves them: packed panels for the CPU kernels."""
    from xlaserve.kernels.attention import resolve_backend

    if resolve_backend(backend, jax.default_backend()) == "cpu":
        return pack_params(model.params)
    return model.params


def teacher_forced(models: tuple[LoadedModel, LoadedModel], ids: list[int], window: int,
                   backend: str = "auto", block_size: int = 16,
                   kv_dtypes: tuple[str | None, str | None] = (None, None)) -> dict[str, float]:
    """Both models over `ids`, window by window: NLL sums, argmax agreement, logit errors;
    each model's KV cache in its `kv_dtypes` entry (None: the model's dtype)."""
    width = -(-window // block_size)
    params = [_runnable(m, backend) for m in models]
    table = np.arange(1, width + 1, dtype=np.int32)
    nll = [0.0, 0.0]
    agree = count = 0
    max_err = sum_err = 0.0
    for chunk in _windows(ids, window):
        inputs, targets = chunk[:-1], np.asarray(chunk[1:])
        n = len(inputs)
        tokens = np.zeros(window, np.int32)
        tokens[:n] = inputs
        positions, meta = one_row_metadata(table, 0, n, window, block_size)
        logits = []
        for m, p, kv_dtype in zip(models, params, kv_dtypes):
            kv = init_kv_cache(m.config, width + 1, block_size, kv_dtype)
            out, _ = _window_logits(p, m.config, jnp.asarray(tokens), jnp.asarray(positions),
                                    kv, meta, backend)
            logits.append(np.asarray(out[:n], np.float64))              # [n, V]
        for i, lg in enumerate(logits):
            lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
            nll[i] += float((lse - lg[np.arange(n), targets]).sum())
        agree += int((logits[0].argmax(-1) == logits[1].argmax(-1)).sum())
        err = np.abs(logits[0] - logits[1])
        max_err = max(max_err, float(err.max()))
        sum_err += float(err.mean()) * n
        count += n
    return {"tokens": count, "ppl_float": math.exp(nll[0] / count),
            "ppl_quantized": math.exp(nll[1] / count), "top1_agreement": agree / count,
            "max_logit_error": max_err, "mean_logit_error": sum_err / count}


def greedy_agreement(models: tuple[LoadedModel, LoadedModel], max_tokens: int,
                     backend: str = "auto",
                     kv_dtypes: tuple[str | None, str | None] = (None, None)
                     ) -> tuple[int, float]:
    """(prompts answered identically, mean tokens before the first difference)."""
    from xlaserve.serving.sequence_generator import SequenceGenerator

    answers: list[list[list[int]]] = []
    for m, kv_dtype in zip(models, kv_dtypes):
        gen = SequenceGenerator(_runnable(m, backend), m.config, max_len=512,
                                attention_backend=backend, kv_dtype=kv_dtype)
        outs = []
        for text in CHAT_PROMPTS:
            prompt = m.tokenizer.encode_chat([{"role": "user", "content": text}])
            outs.append(list(gen.generate(prompt, max_tokens,
                                          stop_ids=m.config.eos_token_ids)))
        answers.append(outs)
    identical, prefixes = 0, []
    for a, b in zip(*answers):
        identical += a == b
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(same)
    return identical, float(np.mean(prefixes))


def quality_report(folder: str | Path, quantization: str | None = "int8", window: int = 256,
                   max_tokens: int = 48, backend: str = "auto",
                   kv_cache_dtype: str | None = None) -> QualityReport:
    """`folder`'s model with int8 or fp8 weights (`quantization`) and / or an int8 or fp8 KV
    cache (`kv_cache_dtype`) against itself in float32."""
    from xlaserve.models.quantize import kv_cache_dtype_name

    base = load_model(folder, dtype="float32")
    quant = load_model(folder, dtype="float32", quantization=quantization)
    ids = base.tokenizer.encode(CORPUS.read_text())
    kv = kv_cache_dtype_name(kv_cache_dtype) if kv_cache_dtype else None
    tf = teacher_forced((base, quant), ids, window, backend, kv_dtypes=(None, kv))
    identical, prefix = greedy_agreement((base, quant), max_tokens, backend,
                                         kv_dtypes=(None, kv))
    what = " + ".join([f"{quantization} weights"] * bool(quantization)
                      + [f"{kv_cache_dtype} KV"] * bool(kv_cache_dtype)) or "float32"
    return QualityReport(
        model=str(folder), quantization=what, tokens=int(tf["tokens"]),
        ppl_float=tf["ppl_float"], ppl_quantized=tf["ppl_quantized"],
        ppl_change=tf["ppl_quantized"] / tf["ppl_float"] - 1,
        top1_agreement=tf["top1_agreement"], max_logit_error=tf["max_logit_error"],
        mean_logit_error=tf["mean_logit_error"], greedy_identical=identical,
        greedy_prompts=len(CHAT_PROMPTS), greedy_mean_prefix=prefix, greedy_tokens=max_tokens)


def format_report(r: QualityReport) -> str:
    return "\n".join([
        f"{r.model}: {r.quantization} against float32, {r.tokens} teacher-forced tokens",
        f"  perplexity        float32 {r.ppl_float:.3f}   quantized "
        f"{r.ppl_quantized:.3f}   ({100 * r.ppl_change:+.2f}%)",
        f"  top-1 agreement   {100 * r.top1_agreement:.2f}%",
        f"  logit error       max {r.max_logit_error:.4f}   mean {r.mean_logit_error:.4f}",
        f"  greedy chat       {r.greedy_identical} of {r.greedy_prompts} answers identical "
        f"over {r.greedy_tokens} tokens; first difference after {r.greedy_mean_prefix:.1f} "
        f"tokens on average",
    ])


def quality_main(folder: str, quantization: str | None, window: int, max_tokens: int,
                 backend: str, json_out: str | None, kv_cache_dtype: str | None = None) -> int:
    report = quality_report(folder, quantization, window, max_tokens, backend, kv_cache_dtype)
    print(format_report(report))
    if json_out:
        write_json(json_out, asdict(report), indent=2)
    return 0
