"""Load a model folder: config, parameters (into their shardings on a mesh) and tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from jax.sharding import Mesh

from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_mesh

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    mesh: Mesh


def load_model(folder: str | Path, *, dtype: str | None = None,
               quantization: str | None = None, mesh: Mesh | None = None) -> LoadedModel:
    config = load_config(folder, dtype, quantization)
    mesh = mesh or make_mesh()
    if config.quantization == "fp8":   # a GPU option: refused on CPU (kernels/quantized.py)
        from xlaserve.kernels.quantized import check_fp8_platform

        check_fp8_platform(f"quantization='fp8' (model {folder})", mesh.devices.flat[0].platform)
    if config.dtype != "float32" and mesh.devices.flat[0].platform == "cpu":
        # Measured (BENCHMARKS.md, "dtypes on the CPU backend"): XLA:CPU runs bf16 scatters
        # as f32 over a converted copy of the whole operand, so every KV-cache write copies
        # the cache (~50x slower decode); its bf16/f16 dots are slower than f32 as well.
        log.warning("dtype %s on the CPU backend is slower than float32 (bfloat16 decode "
                    "steps ~50x, float16 ~1.3x); serve with --dtype float32 on CPU",
                    config.dtype)
    params = load_params(folder, config, mesh)
    return LoadedModel(config, params, Tokenizer.load(folder), mesh)
