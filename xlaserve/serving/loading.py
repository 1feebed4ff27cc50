"""Load a model folder: config, parameters (into their shardings on a mesh) and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jax.sharding import Mesh

from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_mesh


@dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    mesh: Mesh


def load_model(folder: str | Path, *, dtype: str | None = None,
               mesh: Mesh | None = None) -> LoadedModel:
    config = load_config(folder, dtype)
    mesh = mesh or make_mesh()
    params = load_params(folder, config, mesh)
    return LoadedModel(config, params, Tokenizer.load(folder), mesh)
