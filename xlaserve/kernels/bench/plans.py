"""What gpu_check measures: the H200 plan (`gpu_plan`) and the CPU smoke plan's tiny shapes
(`smoke_plan`, kernels in interpret mode: proves the script runs)."""

from __future__ import annotations

from typing import Any

from xlaserve.kernels.bench.attention_checks import AttnShape


def gpu_plan() -> dict[str, Any]:
    from xlaserve.models.config import ModelConfig

    g8 = dict(heads=32, kv_heads=4, head_dim=128)   # GQA 8:1 (Llama-3-8B-like heads)
    g3 = dict(heads=9, kv_heads=3, head_dim=64)     # GQA 3:1 (SmolLM2)
    check = [AttnShape(3, 1000, block_size=16, **g8), AttnShape(4, 777, block_size=32, **g3),
             AttnShape(2, 600, block_size=16, chunk=200, **g3),
             AttnShape(2, 1100, block_size=32, chunk=64, **g8)]
    timed = [
        AttnShape(1, 1024, block_size=16, **g8), AttnShape(1, 32768, block_size=16, **g8),
        AttnShape(32, 8192, block_size=16, **g8), AttnShape(32, 8192, block_size=32, **g8),
        AttnShape(256, 1024, block_size=16, **g8), AttnShape(256, 4096, block_size=32, **g8),
        AttnShape(1, 32768, block_size=16, **g3), AttnShape(32, 8192, block_size=32, **g3),
        AttnShape(256, 2048, block_size=16, **g3), AttnShape(256, 32768, block_size=16, **g3),
        AttnShape(1, 4096, block_size=16, chunk=512, **g3),
        AttnShape(8, 2048, block_size=16, chunk=256, **g8),
    ]
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          tie_word_embeddings=True, dtype="bfloat16")
    return dict(check=check, timed=timed, model=smollm2, label="SmolLM2-135M shapes",
                batches=[1, 32, 256], context=1024,
                repeats=30, bandwidth_bytes=2 << 30, reference_limit=8 << 30,
                fp8_matmul=[(1, 576, 1536), (32, 4096, 4096), (256, 1536, 576)],
                fp8_timed=(1, 8192, 8192), quantized_batches=[1, 32], quantized_model=smollm2,
                quantized_variants=[("int8", None), ("fp8", None), ("fp8", "float8_e4m3fn")])


def smoke_plan() -> dict[str, Any]:
    from xlaserve.models.config import ModelConfig

    g3 = dict(heads=6, kv_heads=2, head_dim=16)
    check = [AttnShape(2, 37, block_size=8, **g3),
             AttnShape(2, 21, block_size=8, chunk=5, **g3)]
    timed = [AttnShape(2, 64, block_size=16, **g3),
             AttnShape(1, 40, block_size=8, chunk=8, **g3)]
    tiny = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=6, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    return dict(check=check, timed=timed, model=tiny, label="tiny 2-layer",
                batches=[1, 2], context=20, repeats=10,
                bandwidth_bytes=1 << 20, reference_limit=1 << 40,
                fp8_matmul=[(3, 64, 40)], fp8_timed=(1, 64, 64), quantized_batches=[1],
                # head_dim 32: wo's groups of 32 run along each head's D
                quantized_model=tiny.replace(hidden_size=64, num_heads=2, num_kv_heads=1,
                                             head_dim=32),
                quantized_variants=[("fp8", "float8_e4m3fn")])   # the GPU plan: int8 and fp8 too
