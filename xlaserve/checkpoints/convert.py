"""`xlaserve convert gguf|hf SRC OUT`: any supported source -> an xlaserve model folder."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.checkpoints.family_tensors import adapted, adapted_int8
from xlaserve.checkpoints.gguf_file import gguf_tokenizer_fields, read_gguf
from xlaserve.checkpoints.layout import params_from_hf
from xlaserve.checkpoints.store import CONFIG_FILE, atomic_folder, check_output, save_params
from xlaserve.models.config import ModelConfig
from xlaserve.models.families import config_from_hf
from xlaserve.models.quantize import check_quantization, quantize_params

log = logging.getLogger(__name__)


def _bar(desc: str, quiet: bool):
    def progress(it: Iterable[int]) -> Iterable[int]:
        return tqdm(it, desc=desc, unit="layer", disable=quiet)
    return progress


def quantized(config: ModelConfig, params: dict, quantize: str | None
              ) -> tuple[ModelConfig, dict]:
    """The converted parameters as the folder stores them: float, or `quantize` ("int8",
    "fp8"); entries already quantized (GGUF Q8_0 read as int8) are kept as they are."""
    check_quantization(quantize, "--quantize")
    if quantize is None:
        return config, params
    return config.replace(quantization=quantize), quantize_params(params, quantize)


def convert_gguf(src: str | Path, out: str | Path, *, overwrite: bool = False,
                 quiet: bool = False, quantize: str | None = None) -> ModelConfig:
    from xlaserve.checkpoints.gguf_tokenizer import tokenizer_from_gguf

    check_output(out, overwrite, src)
    model = read_gguf(src)
    config = model.config
    with atomic_folder(out, overwrite, src) as tmp:
        # --quantize int8: Q8_0 matrices are copied as the int8 they are (gguf_file.py)
        m = model.residual_multiplier
        get_int8 = adapted_int8(config, model.get_int8 if quantize == "int8" else None, m)
        get = adapted(config, model.get, residual_multiplier=m, norms_hold_one=True)
        params = params_from_hf(config, get, _bar(f"reading {Path(src).name}", quiet),
                                get_int8)
        config, params = quantized(config, params, quantize)
        save_params(tmp, params)
        try:
            tokenizer_from_gguf(gguf_tokenizer_fields(src), tmp)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{src}: tokenizer: {e}") from e
        config.save(tmp / CONFIG_FILE)
    return config


def text_tower_names(hf: dict, stored: Iterable[str]) -> dict[str, str]:
    """HF Llama-style name -> the name stored: itself, or for a `gemma3` image-text checkpoint
    its text tower's (`model.language_model.*` / `language_model.model.*`), the vision
    weights left out with one log line."""
    if hf.get("model_type") != "gemma3":
        return {n: n for n in stored}
    out, skipped = {}, 0
    for n in stored:
        for prefix, ours in (("model.language_model.", "model."),
                             ("language_model.model.", "model."),
                             ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
            if n.startswith(prefix):
                out[ours + n[len(prefix):]] = n
                break
        else:
            skipped += 1
    log.info("gemma3: serving the text tower; %d vision tensors skipped", skipped)
    return out


def convert_hf(src: str | Path, out: str | Path, *, overwrite: bool = False,
               quiet: bool = False, quantize: str | None = None) -> ModelConfig:
    from safetensors import safe_open

    from xlaserve.serving.tokenizer import hf_stop_ids, tokenizer_from_hf

    src = Path(src)
    check_output(out, overwrite, src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such directory")
    cfg_path = src / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{src}: no config.json")
    try:
        hf = json.loads(cfg_path.read_text())
        config = config_from_hf(hf)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: {type(e).__name__}: {e}") from e
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src}: no *.safetensors files")
    handles = {}
    where: dict[str, Path] = {}
    try:
        for f in files:
            h = safe_open(str(f), framework="numpy")
            handles[f] = h
            for name in h.keys():
                where[name] = f
    except Exception as e:
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
    names = text_tower_names(hf, where)
    if config.tie_word_embeddings is False and "lm_head.weight" not in names:
        config = config.replace(tie_word_embeddings=True)

    def get(name: str):
        if name not in names:
            raise CheckpointError(f"{src}: tensor {name} is missing from the safetensors files")
        stored = names[name]
        return handles[where[stored]].get_tensor(stored)

    get = adapted(config, get, residual_multiplier=float(hf.get("residual_multiplier", 1.0)))
    with atomic_folder(out, overwrite, src) as tmp:
        params = params_from_hf(config, get, _bar(f"converting {src.name}", quiet))
        config, params = quantized(config, params, quantize)
        save_params(tmp, params)
        tokenizer_from_hf(src, tmp, config.eos_token_ids)
        # the model stops where its checkpoint says: generation_config.json and the tokenizer's
        # eos as well as config.json (`xlaserve generate`, the bench commands read these)
        config = config.replace(eos_token_ids=tuple(hf_stop_ids(src, config.eos_token_ids)))
        config.save(tmp / CONFIG_FILE)
    return config
